"""Synthetic episodes for the buffer's tests and benchmark (no model needed).

``make_group`` builds one GRPO group of ``size`` episodes with deterministic ids (``{group_id}/{i}``), rewards
that vary within the group unless asked otherwise, and realistic token, logprob and version arrays.
"""

from __future__ import annotations

import numpy as np

from topics.schemas import Episode


def make_group(group_id: str, size: int = 4, *, prompt_len: int = 8, response_len: int = 16, version: int = 0,
               rewards: list[float] | None = None, seed: int = 0, vocab: int = 64) -> list[Episode]:
    rng = np.random.default_rng(abs(hash((group_id, seed))) % 2**32)
    prompt = rng.integers(3, vocab, prompt_len, dtype=np.int32)
    out = []
    for i in range(size):
        reward = float(rewards[i]) if rewards is not None else float(i % 2)
        out.append(Episode(
            episode_id=f"{group_id}/{i}", group_id=group_id, group_size=size, prompt_id=group_id, task="synthetic",
            prompt_tokens=prompt, response_tokens=rng.integers(3, vocab, response_len, dtype=np.int32),
            logprobs=-rng.random(response_len, dtype=np.float32),
            token_versions=np.full(response_len, version, dtype=np.int32), policy_version=version,
            reward=reward, finish_reason="stop", generator_id="synthetic",
        ))
    return out
