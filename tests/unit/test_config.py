"""Config loading: YAML + environment + overrides onto the dataclasses; bad keys and values name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamforge.config import RunConfig, env_overrides, load_config
from topics.errors import ConfigError


def test_defaults_validate() -> None:
    cfg = load_config(None, [], environ={})
    assert isinstance(cfg, RunConfig)
    assert cfg.names.episodes == "sf.episodes"


def test_yaml_env_and_overrides_compose(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  prefix: demo\ntrainer:\n  lr: 0.001\n  max_steps: 5\n")
    cfg = load_config(path, ["--trainer.max_steps=7"],
                      environ={"STREAMFORGE_KAFKA_BOOTSTRAP": "h:9092", "STREAMFORGE_TRAINER__LR": "0.002",
                               "STREAMFORGE_GENERATOR_GROUP_SIZE": "4", "HOME": "/root"})
    assert cfg.run.prefix == "demo"
    assert cfg.trainer.lr == pytest.approx(0.002)  # env beats the file
    assert cfg.trainer.max_steps == 7  # overrides beat the env
    assert cfg.kafka.bootstrap == "h:9092"
    assert cfg.generator.group_size == 4


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["--trainer.nope=1"], "trainer.nope"),
        (["--nosection.x=1"], "nosection"),
        (["--trainer.lr=fast"], "trainer.lr"),
        (["--trainer.lr=-1"], "trainer.lr"),
        (["--trainer.threads=-1"], "trainer.threads"),
        (["--kafka.fetch_max_wait_ms=0"], "kafka.fetch_max_wait_ms"),
        (["--kafka.bootstrap=nohostport"], "kafka.bootstrap"),
        (["--generator.prompt_source=web"], "generator.prompt_source"),
        (["--generator.max_num_seqs=-1"], "generator.max_num_seqs"),
        (["--generator.max_num_batched_tokens=-8"], "generator.max_num_batched_tokens"),
        (["trainer.lr"], "trainer.lr"),
        (["--topics.retention_ms.batch=-1"], "topics.retention_ms.batch"),
        (["--topics.retention_bytes.episodes=0"], "topics.retention_bytes.episodes"),
        (["--trainer.shared_prefix=true", "--buffer.batching=pack"], "trainer.shared_prefix"),
        (["--trainer.shared_prefix_tokens=0"], "trainer.shared_prefix_tokens"),
    ],
)
def test_bad_config_names_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, environ={})
    assert key in str(err.value)


def test_unknown_yaml_key_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("buffer:\n  group_size_typo: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, [], environ={})
    assert "buffer.group_size_typo" in str(err.value)


def test_missing_or_invalid_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.yaml", [], environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad, [], environ={})


def test_unknown_environment_variable_is_an_error() -> None:
    with pytest.raises(ConfigError) as err:
        env_overrides({"STREAMFORGE_TRAINER_NOT_A_KEY": "1"})
    assert "STREAMFORGE_TRAINER_NOT_A_KEY" in str(err.value)
    with pytest.raises(ConfigError):
        env_overrides({"STREAMFORGE_NOWHERE": "1"})
    assert env_overrides({"STREAMFORGE_NATS_TOKEN": "secret"}) == []  # secrets are read by name, not config


def test_env_names_every_section_key_round_trip() -> None:
    """Every config key has an environment spelling that maps back onto it (deploy/ relies on this)."""
    import dataclasses

    cfg = RunConfig()
    for section in dataclasses.fields(cfg):
        for key in dataclasses.fields(getattr(cfg, section.name)):
            name = f"STREAMFORGE_{section.name.upper()}__{key.name.upper()}"
            assert env_overrides({name: "x"}) == [f"{section.name}.{key.name}=x"]


def test_an_empty_override_sets_the_empty_string() -> None:
    from streamforge.config import load_config

    cfg = load_config(None, ["--model.warmstart_task="])
    assert cfg.model.warmstart_task == ""


def test_retention_per_topic_becomes_the_topics_kafka_configs() -> None:
    config = load_config(None, ["--topics.retention_ms.batches=-1", "--topics.retention_ms.dead-letter=86400000",
                                "--topics.retention_bytes.episodes=1048576"], environ={})
    assert config.topics.topic_configs("batches") == {"retention.ms": "-1"}
    assert config.topics.topic_configs("dead-letter") == {"retention.ms": "86400000"}
    assert config.topics.topic_configs("episodes") == {"retention.bytes": "1048576"}
    assert config.topics.topic_configs("prompts") == {}
