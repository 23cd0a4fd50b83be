"""Terms of the policy losses: masked means, aggregations, the k3 KL, the off-policy mask, the behaviour weight.

The pieces ``consumers/losses.py`` builds its losses of, and the whole batch's counts (``BatchTotals``) that a
data-parallel share normalises by."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

AGGREGATIONS = ("seq", "token", "const")


@dataclass(frozen=True, slots=True)
class BatchTotals:
    """The whole batch's counts, for a data-parallel rank that holds a share of its rows."""

    rows: int  # B, the batch's rows (episodes)
    tokens: float  # the sum of the batch's loss mask
    width: int  # T, the batch's token columns (``const`` aggregation without max_completion_length)


def masked_mean(x: Tensor, mask: Tensor, totals: BatchTotals | None = None) -> Tensor:
    """``sum(x m) / max(1, sum m)``; with ``totals`` the denominator is the whole batch's token count (a share)."""
    tokens = mask.sum().clamp(min=1.0) if totals is None else max(1.0, totals.tokens)
    return (x * mask).sum() / tokens


def aggregate(per_token: Tensor, mask: Tensor, how: str, max_completion_length: int | None = None,
              totals: BatchTotals | None = None) -> Tensor:
    """Reduce ``[B, T]`` (or ``[B, 1]`` broadcast) per-token losses to a scalar; see the module docstring. With
    ``totals`` the rows/tokens/width of the normalisers are the whole batch's, so the result is this share's part."""
    per_token = per_token.expand_as(mask)
    rows = mask.shape[0] if totals is None else totals.rows
    if how == "seq":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / max(1, rows)
    if how == "token":
        return masked_mean(per_token, mask, totals)
    if how == "const":
        width = max_completion_length or (mask.shape[1] if totals is None else totals.width)
        return (per_token * mask).sum() / (max(1, rows) * width)
    raise ValueError(f"unknown aggregation {how!r}")


BEHAVIOUR_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")


def behaviour_weight(prox: Tensor, old: Tensor, mask: Tensor, mode: str, lo: float | None, hi: float | None
                     ) -> Tensor:
    """TRL's vLLM importance-sampling correction, ``sg(pi_prox / pi_behav)`` per token or per row (``sequence_*``:
    ``exp`` of the masked sum of log ratios, ``[B, 1]``), truncated into ``[lo, hi]`` (``*_truncate``) or zeroed
    outside it (``*_mask``); ``None`` bounds are open."""
    diff = torch.nan_to_num((prox - old) * mask, nan=0.0)
    w = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff).detach()
    if mode.endswith("truncate"):
        return torch.clamp(w, min=lo, max=hi)
    bad = (w < (-math.inf if lo is None else lo)) | (w > (math.inf if hi is None else hi))
    return w.masked_fill(bad, 0.0)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def off_policy_mask(advantages: Tensor, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor,
                    threshold: float) -> Tensor:
    """``[B, 1]``: 0 for rows with negative advantage whose mean ``old - sg(logp)`` exceeds ``threshold``."""
    kl = ((old_logprobs - logprobs.detach()) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (kl <= threshold)).to(mask.dtype)
