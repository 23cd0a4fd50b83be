"""The run configuration: one dataclass per component, composed into ``RunConfig``.

Loading order (later wins): dataclass defaults < YAML file < ``STREAMFORGE_<SECTION>_<KEY>`` environment
variables < ``--section.key=value`` overrides. An unknown key or a value of the wrong type fails at start-up with
a ``ConfigError`` naming the key. Environment names: ``STREAMFORGE_KAFKA_BOOTSTRAP`` -> ``kafka.bootstrap``;
``STREAMFORGE_TRAINER__MAX_STEPS`` (double underscore) is the unambiguous spelling of ``trainer.max_steps``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from buffer.config import BufferConfig
from consumers.config import TrainerConfig
from producers.config import FeederConfig, GeneratorConfig
from topics.config import KafkaConfig, NatsConfig, TopicsConfig
from topics.errors import ConfigError
from topics.names import Names, valid_prefix
from weightsync.config import WeightSyncConfig

ENV_PREFIX = "STREAMFORGE_"


@dataclass(kw_only=True, slots=True)
class RunSection:
    """Identity of a run."""

    prefix: str = "sf"  # prefix of every topic, subject and bucket of this run
    run_dir: str = "runs/latest"
    seed: int = 0

    def __post_init__(self) -> None:
        if not valid_prefix(self.prefix):
            raise ConfigError("run.prefix", f"{self.prefix!r} must be letters, digits, '-' or '_'")


@dataclass(kw_only=True, slots=True)
class BrokersConfig:
    """The embedded brokers started by ``streamforge brokers`` and ``streamforge up``."""

    durable: bool = False  # Tansu over a local SeaweedFS (s3://) instead of memory://
    data_dir: str = ""  # empty = <run_dir>/brokers
    kafka_port: int = 0  # 0 = a free port
    nats_port: int = 0
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        for name in ("kafka_port", "nats_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"brokers.{name}", "must be a port number (0 = free port)")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy model, one Hugging Face directory that vLLM, transformers and torchtitan all load."""

    path: str = ""  # HF dir; empty with `tiny` set = build the tiny model into <run_dir>/model
    tiny: str = "char-llama"  # the built-in tiny model recipe used when path and source are empty ("" = none)
    source: str = ""  # a pretrained model by name (producers/hf_models.py: smollm2-135m), converted once into cache_dir
    cache_dir: str = ""  # where `source` models are converted; empty = ~/.cache/streamforge/models
    flavor: str = ""  # torchtitan flavor (empty = derived from the HF config)
    max_seq_len: int = 128
    warmstart_task: str = ""  # toy task for a short supervised warm start of the built tiny model ("" = none)
    warmstart_accuracy: float = 0.3  # stop the warm start at this greedy accuracy

    def __post_init__(self) -> None:
        if not 0 < self.warmstart_accuracy <= 1:
            raise ConfigError("model.warmstart_accuracy", "must be in (0, 1]")
        if not self.path and not self.tiny and not self.source:
            raise ConfigError("model.path", "set a Hugging Face model directory (or model.source, or model.tiny)")
        if self.source:
            from producers.hf_models import SOURCES

            if self.source not in SOURCES:
                raise ConfigError("model.source", f"{self.source!r} is not one of {list(SOURCES)}")
            if self.warmstart_task:
                raise ConfigError("model.warmstart_task", "the warm start is for the built tiny model only")


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    """OpenTelemetry traces and metric backends."""

    traces: str = "jsonl"  # "jsonl" (<run_dir>/traces.jsonl) | "otlp" | "none"
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    metrics: list[str] = field(default_factory=lambda: ["jsonl"])  # console | jsonl | tensorboard | wandb
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.traces not in ("jsonl", "otlp", "none"):
            raise ConfigError("telemetry.traces", "must be jsonl, otlp or none")
        bad = [m for m in self.metrics if m not in ("console", "jsonl", "tensorboard", "wandb")]
        if bad:
            raise ConfigError("telemetry.metrics", f"unknown backends {bad}")


@dataclass(kw_only=True, slots=True)
class UpConfig:
    """What ``streamforge up`` starts."""

    generators: int = 1
    buffers: int = 1
    restart: bool = False  # restart a child that dies instead of stopping the run
    drain_timeout_s: float = 20.0
    max_wall_s: float = 0.0  # >0: stop the whole run (gracefully) after this many seconds
    live: str = "auto"  # progress view: "auto" (rich table on a terminal, lines otherwise) | "table" | "lines"
    lag_every_s: float = 10.0  # how often the view reads consumer lag from Kafka; 0 = never

    def __post_init__(self) -> None:
        if self.generators < 0 or self.buffers < 1:
            raise ConfigError("up.generators", "needs generators >= 0 and buffers >= 1")
        if self.live not in ("auto", "table", "lines"):
            raise ConfigError("up.live", "must be auto, table or lines")
        if self.lag_every_s < 0:
            raise ConfigError("up.lag_every_s", "must be >= 0")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Everything a run needs; each role reads its own sections."""

    run: RunSection = field(default_factory=RunSection)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    nats: NatsConfig = field(default_factory=NatsConfig)
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    brokers: BrokersConfig = field(default_factory=BrokersConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    up: UpConfig = field(default_factory=UpConfig)
    feeder: FeederConfig = field(default_factory=FeederConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weightsync: WeightSyncConfig = field(default_factory=WeightSyncConfig)

    @property
    def names(self) -> Names:
        return Names(self.run.prefix)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.run_dir)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _section_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def env_overrides(environ: Mapping[str, str], cls: type = RunConfig) -> list[str]:
    """Turn ``STREAMFORGE_*`` variables into dotlist overrides; an unknown variable is a ``ConfigError``."""
    sections = _section_fields(cls)
    out: list[str] = []
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        if rest in _NON_CONFIG_ENV:
            continue
        if "__" in rest:
            section, key = rest.split("__", 1)
        else:
            match = [s for s in sections if rest.startswith(s + "_")]
            if not match:
                raise ConfigError(name, "no config section matches this environment variable")
            section = max(match, key=len)
            key = rest[len(section) + 1:]
        if section not in sections:
            raise ConfigError(name, f"unknown config section {section!r}")
        sub = _section_fields(_section_type(cls, section))
        if key not in sub:
            raise ConfigError(name, f"{section}.{key} is not a config key")
        out.append(f"{section}.{key}={value}")
    return out


# Environment variables with the prefix that are not config keys (secrets read by name, process plumbing).
_NON_CONFIG_ENV = {"kafka_password", "nats_token", "nats_password", "role", "config", "log_json"}


def _section_type(cls: type, section: str) -> type:
    default = cls()
    return type(getattr(default, section))


def _overrides_to_dotlist(overrides: Sequence[str]) -> list[str]:
    out = []
    for item in overrides:
        item = item.removeprefix("--")
        if "=" not in item:
            raise ConfigError(item, "an override must look like --section.key=value")
        out.append(item)
    return out


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    environ: Mapping[str, str] | None = None,
    cls: type = RunConfig,
) -> Any:
    """Load YAML + environment + overrides into a validated ``RunConfig`` (raises ``ConfigError``)."""
    environ = os.environ if environ is None else environ
    schema = OmegaConf.structured(cls)
    layers = []
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError as exc:
            raise ConfigError("--config", f"file {path} does not exist") from exc
        except yaml.YAMLError as exc:
            raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError("--config", f"{path} must hold a mapping of sections")
        layers.append(OmegaConf.create(data))
    layers.append(OmegaConf.from_dotlist(env_overrides(environ, cls)))
    layers.append(OmegaConf.from_dotlist(_overrides_to_dotlist(overrides)))
    try:
        merged = OmegaConf.merge(schema, *layers)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        msg = str(exc).splitlines()[0]
        raise ConfigError(str(key), msg) from None
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError("?", str(exc)) from exc


def dump_config(config: Any) -> str:
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)
