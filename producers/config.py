"""Configuration of the generator and feeder roles."""

from __future__ import annotations

from dataclasses import dataclass, field

from topics.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class GeneratorConfig:
    """One generator process: where prompts come from, how it samples, how it scores."""

    generator_id: str = ""  # stable id; empty = "<hostname>-<pid>"
    prompt_source: str = "topic"  # "topic" (Kafka prompts, consumer group) | "local" (feeder.source in-process)
    group_size: int = 8  # samples per prompt = one GRPO group
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_concurrent_prompts: int = 8
    max_policy_lag: int = 1  # stop taking prompts when this many versions ahead of the latest published
    rewards: list[str] = field(default_factory=lambda: ["toy"])  # builtin name or "module:callable"
    reward_weights: list[float] = field(default_factory=list)  # empty = all 1.0
    reward_timeout_s: float = 10.0
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    seed: int = 0
    logprobs_mode: str = "processed_logprobs"  # vLLM: "processed_logprobs" (after temperature etc.) | "raw_logprobs"
    groups_per_version: int = 0  # >0: this generator's share of groups per trainer version (stay <= lag ahead)
    backpressure_stall_s: float = 30.0  # liveness guard of the groups_per_version quota (see producers/flow.py)
    poll_timeout_ms: int = 500  # longest wait for new prompts before re-checking stop and backpressure
    metrics_every_s: float = 5.0  # how often the generator flushes its generator/* metrics

    def __post_init__(self) -> None:
        if self.prompt_source not in ("topic", "local"):
            raise ConfigError("generator.prompt_source", "must be 'topic' or 'local'")
        if self.group_size < 1:
            raise ConfigError("generator.group_size", "must be at least 1")
        if self.max_tokens < 1:
            raise ConfigError("generator.max_tokens", "must be at least 1")
        if self.temperature < 0:
            raise ConfigError("generator.temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("generator.top_p", "must be in (0, 1]")
        if self.max_policy_lag < 0:
            raise ConfigError("generator.max_policy_lag", "must be >= 0")
        if not self.rewards:
            raise ConfigError("generator.rewards", "needs at least one reward")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ConfigError("generator.reward_weights", "needs one weight per reward")
        if self.reward_timeout_s <= 0:
            raise ConfigError("generator.reward_timeout_s", "must be positive")
        if self.max_concurrent_prompts < 1:
            raise ConfigError("generator.max_concurrent_prompts", "must be at least 1")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ConfigError("generator.logprobs_mode", "must be 'processed_logprobs' or 'raw_logprobs'")
        if self.groups_per_version < 0:
            raise ConfigError("generator.groups_per_version", "must be >= 0")
        if self.metrics_every_s <= 0:
            raise ConfigError("generator.metrics_every_s", "must be positive")
        if self.backpressure_stall_s <= 0:
            raise ConfigError("generator.backpressure_stall_s", "must be positive")


@dataclass(kw_only=True, slots=True)
class FeederConfig:
    """The feeder streams a local prompt source into the prompts topic."""

    source: str = "toy:addmod10"  # "toy:<task>" | "jsonl:<path>" | "reasoning_gym:<name>" | "sft_jsonl:<path>"
    num_prompts: int = 0  # 0 = endless (cycles through epochs)
    seed: int = 0
    max_in_flight: int = 64  # prompts ahead of the generators' committed offsets

    def __post_init__(self) -> None:
        kind = self.source.split(":", 1)[0]
        if kind not in ("toy", "jsonl", "reasoning_gym", "sft_jsonl") or ":" not in self.source:
            raise ConfigError("feeder.source", f"{self.source!r} is not toy:, jsonl:, reasoning_gym: or sft_jsonl:")
        if self.num_prompts < 0:
            raise ConfigError("feeder.num_prompts", "must be >= 0")
