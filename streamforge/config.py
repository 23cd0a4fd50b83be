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
from types import SimpleNamespace
from typing import Any, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from buffer.config import BufferConfig
from consumers.config import TrainerConfig
from envs.config import EnvConfig
from producers.config import FeederConfig, GeneratorConfig
from producers.evaluation import EvalConfig
from runtime.context import ModelConfig, RoleContext, RunSection, TelemetryConfig
from services.config import RewardServiceConfig
from streamforge.staleness import DERIVED_KEYS, StalenessConfig, check_staleness, derived_overrides
from topics.config import KafkaConfig, NatsConfig, TopicsConfig
from topics.errors import ConfigError, check_choices
from topics.names import Names
from weightsync.config import WeightSyncConfig

ENV_PREFIX = "STREAMFORGE_"


@dataclass(kw_only=True, slots=True)
class BrokersConfig:
    """The embedded brokers started by ``streamforge brokers`` and ``streamforge up``."""

    # Tansu over a local SeaweedFS (s3://) in data_dir instead of memory://: survives a broker restart, but costs
    # the demo several times its run time (each step slower as the log grows: bench/RESULTS.md, bench/runlog.py)
    durable: bool = False
    # with memory://: copy every record of the run's topics into <run_dir>/log as it is written (logarchive.py),
    # so the run's log outlives `up`: replay, provenance and audit --run-dir restore it into a fresh broker
    archive: bool = True
    data_dir: str = ""  # empty = <run_dir>/brokers
    kafka_port: int = 0  # 0 = a free port
    nats_port: int = 0
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        for name in ("kafka_port", "nats_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"brokers.{name}", "must be a port number (0 = free port)")


@dataclass(kw_only=True, slots=True)
class UpConfig:
    """What ``streamforge up`` starts."""

    generators: int = 1  # generator processes (0: generators run elsewhere)
    buffers: int = 1  # buffer processes in one consumer group (they split the episodes partitions)
    restart: bool = False  # restart a child that dies instead of stopping the run
    drain_timeout_s: float = 20.0  # a graceful stop waits this long for each role to drain
    max_wall_s: float = 0.0  # >0: stop the whole run after this many seconds (a failure: exit code 1)
    live: Literal["auto", "table", "lines"] = "auto"  # progress view: auto = rich table on a terminal, else lines
    lag_every_s: float = 10.0  # how often the view reads consumer lag from Kafka; 0 = never
    envs: int = 1  # replicas of `env.name` (from `env.impl`) started before the generators; none without env.name
    rewards: int = 1  # replicas of `reward.name` (`reward.impl`) started before the generators; none without impl
    service_wait_s: float = 120.0  # how long up waits for the replicas it started to register
    evaluators: int = 0  # 1: start the evaluator (`streamforge run evaluator`, the `eval` section) with the run
    # the roles' malloc: jemalloc keeping freed memory (LD_PRELOAD) where found / required, or glibc (runtime/malloc.py)
    allocator: Literal["auto", "jemalloc", "glibc"] = "auto"
    # on a CPU host of 4 cores or more, give the trainer and the generators' engines disjoint cores unless the
    # trainer's or the generators' own `cpus` says where they go (streamforge/up.py, cpu_plan); false: vLLM's own
    # placement
    cpu_partition: bool = True
    trainer_cpu_share: float = 0.5  # the trainer's share of the cores under cpu_partition (the rest: the engines)

    def __post_init__(self) -> None:
        check_choices(self, "up")
        if not 0.0 < self.trainer_cpu_share < 1.0:
            raise ConfigError("up.trainer_cpu_share", "must be between 0 and 1 (the engines get the other cores)")
        if self.generators < 0:
            raise ConfigError("up.generators", "must be >= 0")
        if self.buffers < 1:
            raise ConfigError("up.buffers", "must be at least 1")
        if self.lag_every_s < 0:
            raise ConfigError("up.lag_every_s", "must be >= 0")
        for key in ("envs", "rewards"):
            if getattr(self, key) < 0:
                raise ConfigError(f"up.{key}", "must be >= 0 (0: the replicas run elsewhere)")
        if self.evaluators not in (0, 1):
            raise ConfigError("up.evaluators", "must be 0 or 1 (one evaluator writes <run_dir>/eval.jsonl)")


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
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    reward: RewardServiceConfig = field(default_factory=RewardServiceConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> None:
        """The rules that span sections, checked when a config is loaded; each error names the keys involved.
        (Not in ``__post_init__``: a test may replace one section of a loaded config to run a role alone.)"""
        if self.model.source:
            from models.hf_models import SOURCES

            if self.model.source not in SOURCES:
                raise ConfigError("model.source", f"{self.model.source!r} is not one of {list(SOURCES)}")
        check_staleness(self)
        check_service_replicas(self)
        check_eval(self)
        episodes = self.buffer.groups_per_batch * self.generator.group_size
        if not self.buffer.token_budget and self.trainer.minibatches > episodes:
            raise ConfigError("trainer.minibatches", f"{self.trainer.minibatches} minibatches of a batch of "
                              f"{episodes} episodes (buffer.groups_per_batch x generator.group_size)")
        if self.trainer.shared_prefix and self.buffer.batching == "pack":
            raise ConfigError("trainer.shared_prefix", "lays out padded batches; buffer.batching pack sends packed "
                              "rows: choose one")

    def context(self) -> RoleContext:
        """What every role shares (``runtime.context``): never the whole run config."""
        return RoleContext(run=self.run, kafka=self.kafka, nats=self.nats, model=self.model,
                           drain_timeout_s=self.up.drain_timeout_s)

    @property
    def names(self) -> Names:
        return Names(self.run.prefix)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.run_dir)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_service_replicas(config: RunConfig) -> None:
    """What ``up`` needs to start the replicas of the configured environment (``up.envs`` of ``env.name``)."""
    env, up = config.env, config.up
    if env.impl and not env.name:
        raise ConfigError("env.name", "env.impl is set: name the service its replicas register under")
    if env.name and up.envs > 0 and not env.impl:
        raise ConfigError("env.impl", f"up starts {up.envs} replica(s) of {env.name!r}: name the environment to serve "
                                      "(a built-in name or 'module:Class'), or set up.envs: 0 if they run elsewhere")
    if env.name and up.envs > 1 and env.port != 0:
        raise ConfigError("env.port", f"{up.envs} replicas on one host cannot share port {env.port}: use 0")
    kind, _, source_env = config.feeder.source.partition(":")
    if kind == "env" and source_env != env.name:
        raise ConfigError("feeder.source", f"{config.feeder.source!r} feeds episodes of {source_env!r}, but env.name "
                                           f"is {env.name!r}: the generator plays env.name")


def check_eval(config: RunConfig) -> None:
    """What the evaluator needs from the other sections: a held-out split (``up`` starts it), a known reward."""
    from producers.evaluation import resolve_source

    if config.up.evaluators:
        resolve_source(config.eval, config.feeder.source)
        if not config.trainer.export_hf and config.weightsync.transport != "file":
            raise ConfigError("trainer.export_hf", "the evaluator loads the HF export of each checkpoint: keep it on "
                                                   "(or use weightsync.transport: file)")
    reward = config.eval.correct_reward
    names = [s.rpartition(":")[2] for s in config.generator.rewards]
    if reward and reward not in config.generator.rewards and reward not in names:
        raise ConfigError("eval.correct_reward", f"{reward!r} is not one of generator.rewards {names}")


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


# Environment variables with the prefix that are not config keys (secrets read by name, process plumbing;
# vllm_poll_s: the poll an Engine hands its vLLM processes, producers/vllm_poll.py, inherited by any role started
# after it by the same process).
_NON_CONFIG_ENV = {"kafka_password", "nats_token", "nats_password", "role", "config", "log_json", "vllm_poll_s"}


def _section_type(cls: type, section: str) -> type:
    default = cls()
    return type(getattr(default, section))


def _overrides_to_dotlist(overrides: Sequence[str]) -> list[str]:
    out = []
    for item in overrides:
        item = item.removeprefix("--")
        if "=" not in item:
            raise ConfigError(item, "an override must look like --section.key=value")
        if item.endswith("="):  # --section.key= sets the empty string (YAML would read it as null)
            item += "''"
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
        if cls is RunConfig:  # the staleness-derived keys: a layer under every explicit one (staleness.py)
            explicit = {k for k in DERIVED_KEYS if any(OmegaConf.select(layer, k) is not None for layer in layers)}
            first = OmegaConf.merge(schema, *layers)  # the sections the derivation reads, each validated alone
            sections = SimpleNamespace(**{k: OmegaConf.to_object(first[k])
                                          for k in ("staleness", "up", "buffer", "trainer")})
            layers.insert(0, OmegaConf.from_dotlist(derived_overrides(sections, explicit)))
        config = OmegaConf.to_object(OmegaConf.merge(schema, *layers))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        msg = str(exc).splitlines()[0]
        raise ConfigError(str(key), msg) from None
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError("?", str(exc)) from exc
    if isinstance(config, RunConfig):
        config.validate()
    return config


def dump_config(config: Any) -> str:
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)
