"""SFT mode: ``SFTExample`` (prompt + completion) -> a ``Batch`` the trainer steps on with the SFT loss.

Tokens: ``tokenizer(prompt)`` (with its special tokens, e.g. ``<bos>``) + ``tokenizer(completion)`` (none) +
``<eos>``, truncated to ``max_seq_len``; ``loss_mask`` is 1 exactly at the completion and ``<eos>`` tokens, so the
loss is on completion tokens only. The Batch keeps the RL layout (right-padded, ``old_logprobs`` 0, advantages 0)
so one broadcast and one ledger serve both modes; its ``batch_id`` hashes the sorted example ids.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from topics.schemas import Batch, SFTExample


def batch_id_of(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:32]


def encode_example(tokenizer: Any, ex: SFTExample, max_seq_len: int) -> tuple[list[int], int]:
    """(token ids, prompt length) for one example."""
    prompt = list(tokenizer(ex.prompt)["input_ids"])
    completion = list(tokenizer(ex.completion, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        completion.append(int(tokenizer.eos_token_id))
    ids = (prompt + completion)[:max_seq_len]
    return ids, min(len(prompt), len(ids))


def collate_sft(tokenizer: Any, examples: list[SFTExample], *, max_seq_len: int) -> Batch:
    rows = [encode_example(tokenizer, ex, max_seq_len) for ex in examples]
    width = max(2, max(len(ids) for ids, _ in rows))
    b = len(rows)
    pad = int(tokenizer.pad_token_id or 0)
    input_ids = np.full((b, width), pad, dtype=np.int32)
    mask = np.zeros((b, width), dtype=np.uint8)
    for i, (ids, plen) in enumerate(rows):
        input_ids[i, : len(ids)] = ids
        mask[i, max(plen, 1): len(ids)] = 1  # position 0 has no prefix to predict it from
    ids = [ex.example_id for ex in examples]
    return Batch(
        batch_id=batch_id_of(ids), episode_ids=ids, group_ids=ids, input_ids=input_ids, loss_mask=mask,
        old_logprobs=np.zeros((b, width), dtype=np.float32), token_versions=np.full((b, width), -1, dtype=np.int32),
        advantages=np.zeros(b, dtype=np.float32), rewards=np.zeros(b, dtype=np.float32),
        prompt_lens=np.array([p for _, p in rows], dtype=np.int32),
        seq_lens=np.array([len(i) for i, _ in rows], dtype=np.int32), pad_token_id=pad, buffer_id="sft",
    )
