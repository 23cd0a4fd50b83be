"""The stated performance model of a simulated RL run: a preset's keys, the global constants, and pure functions.

A preset (``bench/sim/presets/*.yaml``, loaded by ``load_params``) names the run: its fleet (``gpus``,
``async_generation_gpus``, ``generation_tp``), batch (``prompts_per_step`` x ``samples_per_prompt``), lengths
(``response_tokens``, ``prompt_tokens``), model (``model_params_b`` and its shape), GPU (``gpu``), ``staleness``,
``steps`` and the published figure it should reproduce (``paper``). Every speed is derived from those by the rules
below, with the constants of ``CONSTANTS`` (one place, each with its source); no preset sets a speed, unless it
names an override in ``overrides`` (the AReaL presets name none).

* Decoding (one engine of ``generation_tp`` GPUs, ``B`` running sequences holding ``C`` tokens of context in all):
  an iteration advances every running sequence by one token and lasts
  ``max(bytes / (generation_tp x hbm_tb_s x hbm_efficiency), flops / (generation_tp x bf16_tflops x mfu))
  + iteration_overhead_s``, where ``bytes`` = the weights (``weight_bytes`` a parameter) + ``C`` x the KV bytes a
  token (2 x layers x kv_heads x head_dim x ``kv_bytes``) and ``flops`` = 2 x params x ``B`` + 4 x layers x
  heads x head_dim x ``C`` (the attention's dot products). A new group's prompt is prefilled once (the samples
  share it) at ``prefill_s``. Concurrency: an engine admits a group while its context fits its KV pool,
  ``generation_tp x hbm_gb x memory_fraction`` less the weights; the fleet admits at most
  ``max_inflight_prompts`` prompts at once (AReaL's rollout controller: by default the batch size).
* Interruptible generation (``interrupt: recompute``, AReaL 3.1): a weight update discards the running
  sequences' KV and recomputes it, a prefill of their whole contexts; ``keep`` (streamforge's ``keep`` mode)
  continues with the old KV. Loading the weights takes ``weight bytes / link_gb_s``.
* Training (``g`` GPUs, one step on the batch's sequences of lengths ``s``): ``(6 + 2 x logprob_forwards) x params
  x sum(s) + (3 + logprob_forwards) x 2 x layers x heads x head_dim x sum(s^2)`` FLOPs (forward and backward of
  the dense layers and of causal attention, plus the forward passes that recompute logprobs: PPO's old-policy
  recompute, or the decoupled objective's proximal policy) over ``g x bf16_tflops x mfu``, plus per PPO
  minibatch a ring all-reduce of the gradients (``grad_bytes`` a parameter, 2 (g - 1) / g of them over
  ``link_gb_s``).
* Response lengths: lognormal with mean ``response_tokens.mean`` (before the cap) and log-sd ``sigma``, capped at
  ``cap`` (a capped response counts as truncated); prompts uniform in ``[prompt_tokens.min, prompt_tokens.max]``.
  Each prompt's lengths are a function of the seed and the prompt's index in the feed, so every mode trains the
  same batches.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from streamforge.config import load_config
from topics.errors import ConfigError

PRESETS = Path(__file__).resolve().parent / "presets"


@dataclass(frozen=True, slots=True)
class Constants:
    """The model's global constants (never per preset); each line says where its value comes from."""

    # AReaL (arXiv 2505.24298) Fig. 6a: PPO training with dynamic batching reached 427, 455 and 388 TFLOP/s per
    # H800 (1.5B, 7B, 32B); their mean over the 989 TFLOP/s dense bf16/fp16 peak
    mfu: float = 0.43
    # decode streams weights and KV from HBM: fused decode kernels reach about 80% of the peak bandwidth (the
    # usual share a streaming kernel reaches of HBM3's peak: a STREAM-like copy on H100 reads about 85-90%)
    hbm_efficiency: float = 0.8
    # per decode iteration beyond the roofline: kernel launches of a CUDA-graph step, sampling, the scheduler's
    # share not overlapped (SGLang overlaps its scheduler with the GPU); 2 ms is a batch-1 step of a 1.5B model
    # (about 3 ms) less its 1 ms weight read
    iteration_overhead_s: float = 0.002
    kv_bytes: int = 2  # fp16 KV cache (AReaL Table 3)
    weight_bytes: int = 2  # fp16 parameters (AReaL Table 3) read by decode and moved by a weight update
    grad_bytes: int = 4  # fp32 gradients (AReaL Table 3) all-reduced per PPO minibatch
    logprob_forwards: int = 1  # one recompute forward: PPO's old logprobs, or the decoupled objective's proximal


CONSTANTS = Constants()


@dataclass(kw_only=True, slots=True)
class Lengths:
    """Response lengths (module docstring)."""

    distribution: str = "lognormal"
    mean: float = 7250.0  # mean before the cap
    sigma: float = 0.65
    cap: int = 27648

    def __post_init__(self) -> None:
        if self.distribution != "lognormal":
            raise ConfigError("response_tokens.distribution", f"{self.distribution!r}: only 'lognormal'")
        if self.mean <= 0 or self.sigma < 0 or self.cap < 1:
            raise ConfigError("response_tokens", "needs mean > 0, sigma >= 0, cap >= 1")


@dataclass(kw_only=True, slots=True)
class PromptLengths:
    min: int = 64
    max: int = 1024

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max:
            raise ConfigError("prompt_tokens", f"needs 1 <= min <= max, got {self.min}, {self.max}")


@dataclass(kw_only=True, slots=True)
class Gpu:
    name: str = "H800"
    hbm_tb_s: float = 3.35
    bf16_tflops: float = 989.0  # dense
    link_gb_s: float = 50.0  # per GPU, the slowest link a weight update or gradient all-reduce crosses
    hbm_gb: float = 80.0

    def __post_init__(self) -> None:
        for key in ("hbm_tb_s", "bf16_tflops", "link_gb_s", "hbm_gb"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"gpu.{key}", "must be > 0")


@dataclass(kw_only=True, slots=True)
class Shape:
    """The model's shape (its config.json): what sets the KV bytes a token and the attention FLOPs."""

    layers: int = 28
    heads: int = 12
    kv_heads: int = 2
    head_dim: int = 128


@dataclass(kw_only=True, slots=True)
class Paper:
    async_vs_sync: float = 0.0
    source: str = ""
    sync_hours: float = 0.0
    async_hours: float = 0.0
    # effective training throughput (k tokens/s) against the staleness bound, where the paper gives it
    eta_throughput_k: dict[str, float] = field(default_factory=dict)
    eta_response_cap: int = 0  # the cap of the runs the eta curve was measured on (0: the preset's)


@dataclass(kw_only=True, slots=True)
class Overrides:
    """Speeds a preset may set instead of deriving them (0 = derived); a preset that uses one says why."""

    decode_iteration_s: float = 0.0
    train_tokens_per_s_per_gpu: float = 0.0


@dataclass(kw_only=True, slots=True)
class SimParams:
    """One preset (module docstring); ``load_params`` reads it, an unknown key is an error naming it."""

    name: str = ""
    gpus: int = 128
    async_generation_gpus: int = 96
    prompts_per_step: int = 512
    samples_per_prompt: int = 16
    response_tokens: Lengths = field(default_factory=Lengths)
    prompt_tokens: PromptLengths = field(default_factory=PromptLengths)
    model_params_b: float = 1.78
    model_shape: Shape = field(default_factory=Shape)
    gpu: Gpu = field(default_factory=Gpu)
    generation_tp: int = 1
    memory_fraction: float = 0.8  # of an engine's HBM for weights and KV pool (SGLang mem_fraction_static)
    max_inflight_prompts: int = 0  # 0: prompts_per_step (AReaL's default)
    interrupt: str = "recompute"
    ppo_minibatches: int = 4
    staleness: int = 8
    steps: int = 250
    paper: Paper = field(default_factory=Paper)
    overrides: Overrides = field(default_factory=Overrides)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 2 or self.generation_tp < 1:
            raise ConfigError("gpus", "needs at least 2 GPUs and generation_tp >= 1")
        if not 0 < self.async_generation_gpus < self.gpus:
            raise ConfigError("async_generation_gpus", f"{self.async_generation_gpus} must leave training GPUs "
                              f"of the {self.gpus}")
        for key in ("gpus", "async_generation_gpus"):
            if getattr(self, key) % self.generation_tp:
                raise ConfigError(key, f"{getattr(self, key)} is not a multiple of generation_tp "
                                  f"{self.generation_tp}")
        if self.prompts_per_step < 1 or self.samples_per_prompt < 1:
            raise ConfigError("prompts_per_step", "needs prompts_per_step and samples_per_prompt >= 1")
        if self.interrupt not in ("recompute", "keep"):
            raise ConfigError("interrupt", f"{self.interrupt!r}: 'recompute' or 'keep'")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError("memory_fraction", "must be in (0, 1]")
        if self.staleness < -1:
            raise ConfigError("staleness", "must be >= 0, or -1 for no bound")
        if self.steps < 1:
            raise ConfigError("steps", "must be >= 1")

    @property
    def inflight_cap(self) -> int:
        return self.max_inflight_prompts or self.prompts_per_step

    @property
    def params(self) -> float:
        return self.model_params_b * 1e9

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_params(path: str | Path, overrides: list[str] = ()) -> SimParams:
    """A preset file (a name without a folder is looked up in ``bench/sim/presets/``), with ``key=value`` overrides."""
    p = Path(path)
    if not p.exists() and not p.parent.name and (PRESETS / p.name).exists():
        p = PRESETS / p.name
    params = load_config(p, [f"--{o.lstrip('-')}" for o in overrides], environ={}, cls=SimParams)
    if not params.name:
        params.name = p.stem
    return params


def scaled(params: SimParams, factor: int) -> SimParams:
    """The same run with the fleet and the batch divided by ``factor`` (requests per GPU unchanged)."""
    if factor == 1:
        return params
    for key in ("gpus", "async_generation_gpus", "prompts_per_step"):
        if getattr(params, key) % factor:
            raise ConfigError("--scale", f"{factor} does not divide {key} {getattr(params, key)}")
    if params.max_inflight_prompts % factor:
        raise ConfigError("--scale", f"{factor} does not divide max_inflight_prompts {params.max_inflight_prompts}")
    out = replace(params, gpus=params.gpus // factor, async_generation_gpus=params.async_generation_gpus // factor,
                  prompts_per_step=params.prompts_per_step // factor,
                  max_inflight_prompts=params.max_inflight_prompts // factor)
    return out


# -- the rules ------------------------------------------------------------------------------------------------
class Perf:
    """The speeds of one preset's hardware and model (module docstring), in seconds."""

    def __init__(self, params: SimParams, constants: Constants = CONSTANTS) -> None:
        self.p = params
        self.c = constants
        s, g = params.model_shape, params.gpu
        self.kv_per_token = 2 * s.layers * s.kv_heads * s.head_dim * constants.kv_bytes
        self.attn_dim = s.layers * s.heads * s.head_dim  # layers x query width
        self.weight_bytes = params.params * constants.weight_bytes
        self.tp = params.generation_tp
        self.bw = self.tp * g.hbm_tb_s * 1e12 * constants.hbm_efficiency
        self.flops = g.bf16_tflops * 1e12 * constants.mfu  # one GPU's sustained FLOP/s
        pool = self.tp * g.hbm_gb * 1e9 * params.memory_fraction - self.weight_bytes
        if pool <= 0:
            raise ConfigError("memory_fraction", f"{params.name}: the weights do not fit the engine's memory")
        self.kv_capacity = pool / self.kv_per_token  # tokens of context one engine holds

    def iteration_s(self, running: np.ndarray | int, context: np.ndarray | float) -> np.ndarray | float:
        """One decode iteration of engines with ``running`` sequences holding ``context`` tokens (arrays work)."""
        if self.p.overrides.decode_iteration_s:
            return np.zeros_like(np.asarray(running, dtype=float)) + self.p.overrides.decode_iteration_s
        mem = (self.weight_bytes + np.asarray(context) * self.kv_per_token) / self.bw
        comp = (2 * self.p.params * np.asarray(running) + 4 * self.attn_dim * np.asarray(context)) / (
            self.tp * self.flops)
        return np.maximum(mem, comp) + self.c.iteration_overhead_s

    def prefill_s(self, contexts: np.ndarray) -> float:
        """Prefill of sequences of ``contexts`` tokens on one engine (a new prompt, or a recompute of KV)."""
        c = np.asarray(contexts, dtype=float)
        return float((2 * self.p.params * c.sum() + 2 * self.attn_dim * (c * c).sum()) / (self.tp * self.flops))

    @property
    def weight_load_s(self) -> float:
        return self.weight_bytes / (self.p.gpu.link_gb_s * 1e9)

    def train_s(self, seq_lens: np.ndarray, gpus: int) -> float:
        """One training step on sequences of ``seq_lens`` tokens (prompt + response) over ``gpus`` GPUs."""
        s = np.asarray(seq_lens, dtype=float)
        f = self.c.logprob_forwards
        if self.p.overrides.train_tokens_per_s_per_gpu:
            compute = s.sum() / (self.p.overrides.train_tokens_per_s_per_gpu * gpus)
        else:
            flops = (6 + 2 * f) * self.p.params * s.sum() + (3 + f) * 2 * self.attn_dim * (s * s).sum()
            compute = flops / (gpus * self.flops)
        grads = self.p.params * self.c.grad_bytes
        allreduce = 2 * (gpus - 1) / gpus * grads / (self.p.gpu.link_gb_s * 1e9)
        return compute + self.p.ppo_minibatches * allreduce

    def describe(self) -> dict[str, float]:
        """The derived speeds, for the bench's output."""
        return {"kv_bytes_per_token": self.kv_per_token, "kv_capacity_tokens": round(self.kv_capacity),
                "decode_iteration_s_empty": round(float(self.iteration_s(1, 0)), 5),
                "weight_load_s": round(self.weight_load_s, 3),
                "train_tokens_per_s_per_gpu_at_8k": round(8192 / self.train_s(np.array([8192.0]), 1), 1)}


# -- lengths ------------------------------------------------------------------------------------------------
def prompt_lengths(params: SimParams, index: int) -> tuple[int, np.ndarray]:
    """Prompt ``index``'s (in feed order) prompt tokens and its ``samples_per_prompt`` response lengths."""
    rng = np.random.default_rng([params.seed, index])
    pl = params.prompt_tokens
    prompt = int(rng.integers(pl.min, pl.max + 1))
    r = params.response_tokens
    mu = math.log(r.mean) - r.sigma ** 2 / 2
    lengths = np.rint(rng.lognormal(mu, r.sigma, params.samples_per_prompt))
    return prompt, np.clip(lengths, 1, r.cap).astype(np.int64)


def length_stats(params: SimParams, cap: int | None = None, samples: int = 200_000) -> dict[str, float]:
    """Mean and truncated share of the response lengths at ``cap`` (default the preset's)."""
    r = params.response_tokens
    cap = cap or r.cap
    rng = np.random.default_rng(12345)
    mu = math.log(r.mean) - r.sigma ** 2 / 2
    raw = np.rint(rng.lognormal(mu, r.sigma, samples))
    return {"cap": cap, "mean": float(np.clip(raw, 1, cap).mean()), "truncated": float((raw >= cap).mean())}


class EngineSpeed:
    """``Perf`` as the simulated generators and trainer use it (the interface ``model.FleetModel`` also has):
    per-sequence decode rates, pauses, step times, in simulated seconds; ``time_scale`` simulated seconds pass per
    real second, and an Episode carries one token for every ``token_scale`` simulated tokens."""

    def __init__(self, params: SimParams, *, time_scale: float, token_scale: int, train_gpus: int) -> None:
        self.params = params
        self.perf = Perf(params)
        self.time_scale = time_scale
        self.token_scale = token_scale
        self.train_gpus = train_gpus
        self.refresh_s = 2.0  # simulated seconds between re-evaluations of a growing context's iteration time

    def rate(self, running: int, context: float) -> float:
        """Tokens per simulated second of each of ``running`` sequences holding ``context`` tokens in all."""
        return 1.0 / float(self.perf.iteration_s(max(1, running), context))

    def swap_s(self, contexts: list[float]) -> float:
        """A weight update's pause of an engine whose running sequences hold ``contexts``."""
        pause = self.perf.weight_load_s
        if self.params.interrupt == "recompute" and contexts:
            pause += self.perf.prefill_s(np.asarray(contexts))
        return pause

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.perf.prefill_s(np.array([prompt_tokens]))

    def lengths(self, key: int) -> tuple[int, np.ndarray]:
        return prompt_lengths(self.params, key)

    @property
    def cap(self) -> int:
        return self.params.response_tokens.cap

    def train_s(self, seq_lens: np.ndarray) -> float:
        return self.perf.train_s(np.asarray(seq_lens, dtype=float) * self.token_scale, self.train_gpus)
