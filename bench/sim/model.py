"""What the simulation assumes: every distribution and speed, in simulated seconds.

Time scale: ``time_scale`` simulated seconds pass per real second (every simulated sleep is divided by it). Only
the GPUs are simulated: the bytes, messages and CPU seconds of the brokers, the buffer and the clients are real and
never scaled; a rate of a real component per simulated second is a rate per real second divided by
``time_scale``.

* Response lengths: lognormal, median ``length_median`` tokens, log-sd ``length_sigma``, capped at ``length_cap``
  (a capped response finishes with ``"length"``), the long tail of reasoning traces; prompts uniform in
  ``[prompt_min, prompt_max]`` tokens. Token ids uniform in ``[3, vocab)``, logprobs ``-Exp(1)``.
* Rewards: each prompt has a success probability ``p ~ Beta(reward_alpha, reward_beta)``; each of its
  ``group_size`` responses scores 1 with probability ``p``, else 0 (so some groups have zero variance and the
  buffer drops them, as with a real verifier).
* A generator GPU decodes its running sequences with continuous batching: ``c`` sequences each advance at
  ``min(seq_tokens_per_s, tokens_per_s / c)`` tokens per second (one sequence cannot use a whole GPU; a full
  batch shares its throughput). It runs at most ``max_concurrent_prompts`` groups at once.
* A weight swap pauses a generator's decoding for ``model_gb / bandwidth_gb_s`` seconds (running sequences are
  frozen in place and continue with the new version, as ``producers/engine.py``'s ``keep`` mode).
* The trainer spends ``tokens / trainer_tokens_per_s`` seconds on a batch of ``tokens`` (prompt + response tokens
  of its episodes, padding excluded).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(kw_only=True)
class FleetModel:
    """The simulated hardware and workload (module docstring); every time in simulated seconds."""

    tokens_per_s: float = 3000.0  # one generator GPU's decode throughput at a full batch
    seq_tokens_per_s: float = 100.0  # one sequence's decode speed (the GPU's step time, unsaturated)
    max_concurrent_prompts: int = 16  # groups a generator runs at once
    group_size: int = 4
    length_median: float = 512.0
    length_sigma: float = 0.9
    length_cap: int = 4096
    prompt_min: int = 64
    prompt_max: int = 256
    reward_alpha: float = 2.0
    reward_beta: float = 2.0
    model_gb: float = 14.0  # bytes moved per weight swap (a 7B model in bf16)
    bandwidth_gb_s: float = 25.0  # trainer -> generator weight bandwidth
    trainer_tokens_per_s: float = 20000.0
    time_scale: float = 10.0  # simulated seconds per real second
    vocab: int = 32000

    # the interface bench/sim/perf.EngineSpeed shares (the simulated generators and trainer use either)
    token_scale = 1  # an Episode carries every simulated token
    refresh_s = math.inf  # a sequence's rate does not depend on its context

    def swap_s(self, contexts: list[float] = ()) -> float:
        """A weight swap's pause (the running sequences keep their KV)."""
        return self.model_gb / self.bandwidth_gb_s

    def prefill_s(self, prompt_tokens: int) -> float:
        return 0.0

    def rate(self, running: int, context: float = 0.0) -> float:
        """Tokens per simulated second of each of ``running`` sequences."""
        return min(self.seq_tokens_per_s, self.tokens_per_s / max(1, running))

    @property
    def cap(self) -> int:
        return self.length_cap

    def lengths(self, key: int) -> tuple[int, np.ndarray]:
        """Prompt ``key``'s prompt tokens and its ``group_size`` response lengths (a function of the key)."""
        rng = np.random.default_rng([7, key])
        prompt = int(rng.integers(self.prompt_min, self.prompt_max + 1))
        return prompt, np.array([self.response_length(rng) for _ in range(self.group_size)], dtype=np.int64)

    def train_s(self, seq_lens: np.ndarray) -> float:
        return float(np.sum(seq_lens)) / self.trainer_tokens_per_s

    def response_length(self, rng: np.random.Generator) -> int:
        n = round(rng.lognormal(math.log(self.length_median), self.length_sigma))
        return max(1, min(self.length_cap, n))

    def mean_response_length(self, samples: int = 200_000) -> float:
        rng = np.random.default_rng(0)
        n = np.rint(rng.lognormal(math.log(self.length_median), self.length_sigma, samples))
        return float(np.clip(n, 1, self.length_cap).mean())

    def episodes_per_s_per_generator(self) -> float:
        """Episodes one saturated generator makes per simulated second (= per real second unscaled)."""
        return self.tokens_per_s / self.mean_response_length()

    def to_dict(self) -> dict:
        return asdict(self)
