"""Configuration of the generator and feeder roles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from producers.vllm_poll import DEFAULT_POLL_S
from runtime.cpus import parse_cpus
from topics.errors import ConfigError, check_choices
from topics.names import MAX_MEMBER_ID, valid_member_id


@dataclass(kw_only=True, slots=True)
class GeneratorConfig:
    """One generator process: where prompts come from, how it samples, how it scores."""

    generator_id: str = ""  # stable id; empty = "<hostname>-<pid>"
    prompt_source: Literal["topic", "local"] = "topic"  # topic = Kafka prompts (group); local = feeder.source
    group_size: int = 8  # samples per prompt = one GRPO group
    max_tokens: int = 16  # most new tokens per response
    temperature: float = 1.0  # sampling temperature (the trainer scales its logits by it too)
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # top-k sampling (-1 = off)
    max_concurrent_prompts: int = 8  # prompts generating at once
    # wrap each prompt text in the model's chat template as one user turn (and the generation prompt), as an
    # instruct model was tuned on; needs a tokenizer with a chat template (checked at start-up)
    chat_template: bool = False
    system_prompt: str = ""  # with chat_template: a system turn before the user's (empty = none)
    # take no prompt while the weights are more than this many versions older than the latest published
    # (derived from staleness.max_versions: streamforge/staleness.py)
    max_policy_lag: int = 1
    rewards: list[str] = field(default_factory=lambda: ["toy"])  # builtin name or "module:callable"
    reward_weights: list[float] = field(default_factory=list)  # empty = all 1.0
    reward_timeout_s: float = 10.0  # a reward slower than this dead-letters its Episode
    kv_cache_gib: float = 1.0  # vLLM CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    # vLLM's scheduler: most sequences and tokens in one step (0 = vLLM's offline `LLM` defaults for the platform,
    # on CPU 256 and 4096; its server defaults, 128 and 2048, would run a 32 x 8 burst of samples in two waves)
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    # vLLM's KV cache block in tokens (0 = vLLM's own: 128 on CPU, 16 on GPU). Its prefix cache reuses full blocks
    # only, so a group's samples share their prompt's whole blocks and nothing of a prompt shorter than one block:
    # on CPU, 32 (the least its attention takes, in multiples of 32) cut a wave of SmolLM2's 51-token prompts by a
    # third, while it slowed the tiny model's decoding (short prompts, nothing to share) by about a tenth
    # (bench/RESULTS.md, 2026-12-06 evening)
    kv_block_size: int = 0
    # the engine's weights and compute: bfloat16 generates faster on a CPU with avx512_bf16 (bench/bf16.py) and
    # receives the trainer's float32 pushes cast; its logprobs are the behaviour policy's, so the loss's importance
    # ratio against the trainer's float32 logprobs carries the precision mismatch (measured by bench/bf16.py)
    dtype: Literal["float32", "bfloat16"] = "float32"
    # the cores this generator and its vLLM CPU engine run on, a CPU list such as "0" or "0-3" ("" = vLLM's own
    # choice, or `up`'s split between generators); sets VLLM_CPU_OMP_THREADS_BIND (runtime/cpus.py)
    cpus: str = ""
    # the cores of the generator's own process once its engine has started ("" = `cpus`): its event loop (Kafka,
    # rewards, spans, vLLM's request and output handling) then leaves the engine's cores to the engine, e.g. cpus
    # "1" and loop_cpus "0-1" on two cores (runtime/cpus.py); the engine's processes keep `cpus`
    loop_cpus: str = ""
    gpu_memory_utilization: float = 0.5  # vLLM on GPU
    # vLLM: no CUDA graphs / compilation; its torch.compile'd helpers run eagerly too (producers/engine.py)
    enforce_eager: bool = True
    seed: int = 0  # vLLM sampling seed
    # how long vLLM's engine core and worker poll their shared-memory queues after a read before they sleep (vLLM's
    # own is 1 s, which keeps a core busy between bursts of generation; producers/vllm_poll.py); -1 = vLLM's own
    vllm_poll_s: float = DEFAULT_POLL_S
    # vLLM's executor: "mp" runs the model in a worker process beside the engine core's (they hand each scheduler
    # step over through polled shared-memory queues: on two or more cores they overlap scheduling and compute);
    # "uni" runs it in the engine core's process (no handoff: faster for an async generator pinned to one core,
    # but 2-5x slower in sync mode there, bench/RESULTS.md); "auto" = vLLM's own choice (on CPU "mp")
    vllm_executor: Literal["auto", "mp", "uni"] = "auto"
    # how vLLM starts its engine-core and worker processes: "auto" forks them on a CPU host where that is safe (they
    # then skip re-importing vLLM and torch, 7-8 s of CPU each, producers/vllm_fork.py), "spawn" = vLLM's way there
    vllm_start_method: Literal["auto", "fork", "spawn"] = "auto"
    # vLLM: processed_logprobs (after temperature etc.) | raw_logprobs
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    # >0: this generator's share of the groups the trainer trains per step (its quota, producers/flow.py); derived
    # from buffer.groups_per_batch / up.generators (streamforge/staleness.py)
    groups_per_step: float = 0.0
    # the quota holds at most this many trainer steps of groups beyond the trainer's latest published step
    # (derived from staleness.max_versions: streamforge/staleness.py)
    quota_window_steps: int = 3
    # the groups of a full batch (buffer.groups_per_batch, derived): the quota counts the trainer's steps in groups
    # trained over it, so a batch cut short opens it by the groups it held (producers/flow.py); 0 = in steps
    quota_groups_per_batch: int = 0
    quota_counts_zero_variance: bool = True  # False: a group whose rewards are all equal does not use the quota
    # liveness guard of the quota (producers/flow.py); 0 = three times the recent interval between versions, >= 2 s
    backpressure_stall_s: float = 0.0
    poll_timeout_ms: int = 500  # longest wait for new prompts before re-checking stop and backpressure
    metrics_every_s: float = 5.0  # how often the generator flushes its generator/* metrics

    def engine_executor(self) -> str | None:
        """vLLM's executor for this generator's engine (``vllm_executor``; None leaves vLLM's choice)."""
        return None if self.vllm_executor == "auto" else self.vllm_executor

    def __post_init__(self) -> None:
        check_choices(self, "generator")
        if self.generator_id and not valid_member_id(self.generator_id):
            raise ConfigError("generator.generator_id", f"{self.generator_id[:40]!r}...: at most {MAX_MEMBER_ID} "
                              "letters, digits and . _ : @ - (starting with a letter or digit)")
        if self.group_size < 1:
            raise ConfigError("generator.group_size", "must be at least 1")
        parse_cpus(self.cpus, key="generator.cpus")
        parse_cpus(self.loop_cpus, key="generator.loop_cpus")
        if self.max_tokens < 1:
            raise ConfigError("generator.max_tokens", "must be at least 1")
        if self.temperature < 0:
            raise ConfigError("generator.temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("generator.top_p", "must be in (0, 1]")
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"generator.{key}", "must be >= 0 (0 = vLLM's default)")
        if self.kv_block_size < 0 or self.kv_block_size % 16:
            raise ConfigError("generator.kv_block_size", "must be 0 (vLLM's own) or a multiple of 16 tokens")
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
        if self.groups_per_step < 0:
            raise ConfigError("generator.groups_per_step", "must be >= 0 (0 = no quota)")
        if self.system_prompt and not self.chat_template:
            raise ConfigError("generator.system_prompt", "needs generator.chat_template: true")
        if self.quota_groups_per_batch < 0:
            raise ConfigError("generator.quota_groups_per_batch", "must be >= 0 (0 = count the quota in steps)")
        if self.quota_window_steps < 1:
            raise ConfigError("generator.quota_window_steps", "must be at least 1")
        if self.metrics_every_s <= 0:
            raise ConfigError("generator.metrics_every_s", "must be positive")
        if self.vllm_poll_s < 0 and self.vllm_poll_s != -1:
            raise ConfigError("generator.vllm_poll_s", "must be >= 0 seconds, or -1 for vLLM's own")
        if self.backpressure_stall_s < 0:
            raise ConfigError("generator.backpressure_stall_s", "must be >= 0 (0 = adaptive)")


@dataclass(kw_only=True, slots=True)
class FeederConfig:
    """The feeder streams a local prompt source into the prompts topic."""

    # "toy:<task>" | "jsonl:<path>" | "reasoning_gym:<name>" | "sft_jsonl:<path>" | "env:<env.name>"
    source: str = "toy:addmod10"
    num_prompts: int = 0  # 0 = endless (cycles through epochs)
    seed: int = 0
    max_in_flight: int = 64  # prompts ahead of the generators' committed offsets

    def __post_init__(self) -> None:
        kind = self.source.split(":", 1)[0]
        if kind not in ("toy", "jsonl", "reasoning_gym", "sft_jsonl", "env") or ":" not in self.source:
            raise ConfigError("feeder.source", f"{self.source!r} is not toy:, jsonl:, reasoning_gym:, sft_jsonl: or "
                                               "env:")
        if self.num_prompts < 0:
            raise ConfigError("feeder.num_prompts", "must be >= 0")
