"""The small shared context every role receives beside its own config section, and the sections it is made of.

A role never sees the whole run configuration (``streamforge.config.RunConfig``, the app layer): it gets its own
section (``GeneratorConfig``, ``BufferConfig``, ...) and a ``RoleContext``: the run's identity (prefix, run
directory, seed), how to reach Kafka and NATS, which model, and how long a graceful drain may take. The app
builds both from the run configuration (``RunConfig.context()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from topics.config import KafkaConfig, NatsConfig
from topics.errors import ConfigError, check_choices
from topics.names import Names, valid_prefix


@dataclass(kw_only=True, slots=True)
class RunSection:
    """Identity of a run."""

    prefix: str = "sf"  # prefix of every topic, subject and bucket of this run
    run_dir: str = "runs/latest"  # where every role writes its files (metrics, traces, checkpoints, ledger)
    seed: int = 0  # seed of the built tiny model and of the roles' own randomness

    def __post_init__(self) -> None:
        if not valid_prefix(self.prefix):
            raise ConfigError("run.prefix", f"{self.prefix!r} must be letters, digits, '-' or '_'")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy model, one Hugging Face directory that vLLM, transformers and torchtitan all load."""

    path: str = ""  # HF dir; empty with `tiny` set = build the tiny model into <run_dir>/model
    tiny: str = "char-llama"  # the built-in tiny model recipe used when path and source are empty ("" = none)
    source: str = ""  # a pretrained model by name (models/hf_models.py: smollm2-135m), converted once into cache_dir
    cache_dir: str = ""  # where `source` models are converted; empty = ~/.cache/streamforge/models
    flavor: str = ""  # torchtitan flavor (empty = derived from the HF config)
    max_seq_len: int = 128  # prompt + response tokens the engines and the trainer accept
    warmstart_task: str = ""  # toy task for a short supervised warm start of the built tiny model ("" = none)
    warmstart_accuracy: float = 0.3  # stop the warm start at this greedy accuracy

    def __post_init__(self) -> None:
        if not 0 < self.warmstart_accuracy <= 1:
            raise ConfigError("model.warmstart_accuracy", "must be in (0, 1]")
        if not self.path and not self.tiny and not self.source:
            raise ConfigError("model.path", "set a Hugging Face model directory (or model.source, or model.tiny)")
        if self.max_seq_len < 2:
            raise ConfigError("model.max_seq_len", "must be at least 2")
        if self.source and self.warmstart_task:
            raise ConfigError("model.warmstart_task", "the warm start is for the built tiny model only")


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    """OpenTelemetry traces and metric backends."""

    traces: Literal["jsonl", "otlp", "none"] = "jsonl"  # jsonl = <run_dir>/traces.jsonl; otlp = a collector
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"  # the OTLP/HTTP traces endpoint with traces=otlp
    metrics: list[str] = field(default_factory=lambda: ["jsonl"])  # any of console | jsonl | tensorboard | wandb
    wandb_project: str = "streamforge"  # the W&B project of the wandb backend (WANDB_MODE=offline works offline)
    log_level: str = "INFO"  # Python logging level of every role

    def __post_init__(self) -> None:
        check_choices(self, "telemetry")
        bad = [m for m in self.metrics if m not in ("console", "jsonl", "tensorboard", "wandb")]
        if bad:
            raise ConfigError("telemetry.metrics", f"unknown backends {bad}")


@dataclass(kw_only=True, slots=True)
class RoleContext:
    """What every role shares: run identity, broker clients' settings, the model, the drain bound."""

    run: RunSection = field(default_factory=RunSection)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    nats: NatsConfig = field(default_factory=NatsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    drain_timeout_s: float = 20.0  # a graceful stop waits this long for in-flight work (``up.drain_timeout_s``)

    @property
    def names(self) -> Names:
        return Names(self.run.prefix)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.run_dir)
