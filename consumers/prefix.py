"""Shared-prefix rows: a group's prompt runs through the model once, not once per sample (``trainer.shared_prefix``).

The samples of a GRPO group share their prompt: in a padded batch of ``G`` groups of ``N`` samples the model runs
``G x N`` copies of each prompt, and on short answers the prompt is most of the tokens (SmolLM2's ~50-token chat
prompt against answers of at most 32). This layout puts a group in one row: its common prefix (the longest prefix
all its episodes share, cut before the first token any of them is trained on), then each episode's own suffix
one after the other, then padding. A suffix attends to the prefix and causally to itself, never to another
suffix; its positions (RoPE) continue from the prefix, so every suffix token sees exactly what it sees in its
own padded row, and its logprob is the same up to float rounding. The gradient of the prompt's hidden states is
the sum over the samples, as it is when each row holds its own copy.

``shared_prefix_layout(batch, width, row_tokens)`` returns numpy arrays for ``consumers/step.py``:

* ``input_ids``, ``position_ids``, ``segment_ids`` ``[R, W]``: segment 0 is the prefix, ``k + 1`` the row's
  ``k``-th suffix, ``-1`` padding (``attention_mask`` turns them into the dense mask the model takes);
* ``prev`` ``[R, W]``: the column whose hidden state predicts each token (the token before it in its own
  episode: for a suffix's first token, the prefix's last);
* ``scored`` ``[R, W]``: the trained (loss-mask) tokens;
* ``unpack_index``, ``unpack_valid`` ``[B, T]``: each episode token's flat index into the rows, as for packed
  batches (``StepInputs.per_episode``).

A group whose suffixes do not fit ``row_tokens`` (with the prefix) continues in another row with its own copy of
the prefix; an episode longer than that gets a row to itself. The attention mask is dense (``[R, 1, W, W]``), so
the row cap bounds its size: short answers gain most, long ones little (the prefix is then a small share).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from topics.schemas import Batch


@dataclass(slots=True)
class PrefixRows:
    input_ids: np.ndarray
    position_ids: np.ndarray
    segment_ids: np.ndarray
    prev: np.ndarray
    scored: np.ndarray
    unpack_index: np.ndarray
    unpack_valid: np.ndarray


def common_prefix(ids: np.ndarray, lens: np.ndarray, mask: np.ndarray) -> int:
    """Length of the longest prefix every row of ``ids`` shares, cut before the first trained token of any row
    (``mask``) and within every row's length."""
    limit = int(lens.min())
    trained = np.flatnonzero(mask.any(axis=0))
    if trained.size:
        limit = min(limit, int(trained[0]))
    if limit <= 0:
        return 0
    same = (ids[:, :limit] == ids[:1, :limit]).all(axis=0)
    differ = np.flatnonzero(~same)
    return int(differ[0]) if differ.size else limit


def shared_prefix_layout(batch: Batch, width: int, row_tokens: int) -> PrefixRows:
    """The batch's (padded) episodes in shared-prefix rows (module docstring); ``width`` columns of the batch
    hold every token."""
    ids = batch.input_ids[:, :width]
    mask = batch.loss_mask[:, :width] > 0
    lens = np.minimum(batch.seq_lens.astype(np.int64), width)
    order: dict[str, list[int]] = {}
    for b, g in enumerate(batch.group_ids):
        order.setdefault(g, []).append(b)
    rows: list[tuple[int, int, list[int]]] = []  # (prefix length, episode holding the prefix, episodes)
    for members in order.values():
        idx = np.asarray(members)
        p = common_prefix(ids[idx], lens[idx], mask[idx])
        cap = max(row_tokens, p + int(max(lens[b] - p for b in members)))
        row: list[int] = []
        used = p
        for b in members:
            n = int(lens[b]) - p
            if row and used + n > cap:
                rows.append((p, row[0], row))
                row, used = [], p
            row.append(b)
            used += n
        rows.append((p, row[0], row))

    w = max(2, max((p + sum(int(lens[b]) - p for b in members) for p, _, members in rows), default=0))
    r = len(rows)
    out_ids = np.zeros((r, w), np.int64)
    pos = np.zeros((r, w), np.int64)
    seg = np.full((r, w), -1, np.int64)
    prev = np.zeros((r, w), np.int64)
    scored = np.zeros((r, w), bool)
    t = max(int(lens.max()) if lens.size else 0, 2)
    unpack = np.zeros((len(batch.group_ids), t), np.int64)
    valid = np.zeros((len(batch.group_ids), t), bool)
    for i, (p, first, members) in enumerate(rows):
        out_ids[i, :p] = ids[first, :p]
        pos[i, :p] = np.arange(p)
        seg[i, :p] = 0
        prev[i, 1:p] = np.arange(p - 1)
        at = p
        for k, b in enumerate(members):
            n = int(lens[b]) - p
            cols = np.arange(at, at + n)
            out_ids[i, cols] = ids[b, p:p + n]
            pos[i, cols] = np.arange(p, p + n)
            seg[i, cols] = k + 1
            prev[i, cols] = cols - 1
            if n:
                prev[i, at] = max(p - 1, 0)
            scored[i, cols] = mask[b, p:p + n]
            if p == 0 and n:  # no prefix: the episode's first token has nothing before it
                scored[i, at] = False
            unpack[b, :p] = i * w + np.arange(p)
            unpack[b, p:p + n] = i * w + cols
            valid[b, :p + n] = True
            at += n
    return PrefixRows(out_ids, pos, seg, prev, scored, unpack, valid)


def attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[R, 1, W, W]`` boolean mask (True = may attend) of shared-prefix rows: query ``i`` sees key ``j <= i``
    of its own segment, and a suffix also sees the prefix (segment 0). Padding (``-1``) sees earlier padding, so
    no query row is empty (SDPA would give NaN)."""
    w = segment_ids.shape[-1]
    causal = torch.ones(w, w, dtype=torch.bool, device=segment_ids.device).tril()
    q, k = segment_ids.unsqueeze(-1), segment_ids.unsqueeze(-2)
    return (causal & ((q == k) | ((k == 0) & (q > 0)))).unsqueeze(1)
