"""Several optimizer steps per batch: minibatches, PPO epochs and the proximal policy of a decoupled loss.

With ``trainer.minibatches`` ``M`` and ``trainer.ppo_epochs`` ``E`` (both 1 by default: one step on the whole
batch), a batch's token rows are cut into ``M`` contiguous minibatches (``split_rows``: whole episodes, sizes
differing by at most one row; a packed batch with fewer rows than ``M`` has fewer, never an empty one) and the
trainer takes ``E x M`` optimizer steps: every minibatch once per epoch, in the same order each epoch (a replay of
the run trains them again identically). Each minibatch is a batch in its own right: its loss is normalised by its
own rows and tokens (split over the data-parallel ranks like a whole batch, ``consumers/engine.py``).

A loss that asks for the proximal policy (``wants_proximal``: ``decoupled_ppo``) receives ``prox_logprobs``: the
logprobs of each minibatch under the weights *before the batch's first update*, one no-grad forward per minibatch
taken before any step (AReaL's recomputed logprobs). Its clip is anchored there, so it binds once the weights have
moved: from the second step of the batch on. With one step per batch no forward is made: the loss's default,
``sg(logprobs)``, is the proximal policy then.

The learning-rate schedule counts batches (trainer steps), not optimizer steps: every step of a batch uses the
batch's learning rate, and ``warmup_steps`` and ``max_steps`` keep their meaning whatever ``E x M``.

Metrics stay one row per batch (``metrics.jsonl``): every metric of the loss (``loss``, ``kl``, ``clip_fraction``
...), ``grad_norm`` (before clipping) and ``logprob_drift`` are means over the batch's optimizer steps; ``tokens``
is the batch's response tokens (counted once, not once per epoch), ``step_s`` the time of all its steps,
``skipped`` how many of them a non-finite gradient skipped, and ``updates`` how many there were.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from topics.schemas import Batch

# (minibatch, its proximal logprobs or None, advance the schedule) -> the step's global metrics
Update = Callable[[Batch, "torch.Tensor | None", bool], dict[str, float]]
SplitRows = Callable[[Batch, int, int], tuple[Batch, int]]


def minibatches(batch: Batch, n: int, split_rows: SplitRows) -> list[Batch]:
    """``batch`` cut into at most ``n`` contiguous minibatches of whole rows; none empty or without a response
    token."""
    if n == 1:
        return [batch]
    out = []
    for i in range(n):
        mb, real = split_rows(batch, i, n)
        if real and mb.loss_mask.any():
            out.append(mb)
    return out


def ppo_update(batch: Batch, *, epochs: int, n_minibatches: int, split_rows: SplitRows, update: Update,
               proximal: Callable[[Batch], torch.Tensor] | None) -> dict[str, float]:
    """``epochs x minibatches`` optimizer steps on ``batch`` (module docstring); ``proximal`` (None when the loss
    does not ask) gives a minibatch's proximal logprobs, all taken before the first step. Returns the batch's
    metrics (``combine_metrics``)."""
    mbs = minibatches(batch, n_minibatches, split_rows)
    prox = [proximal(mb) for mb in mbs] if proximal is not None else [None] * len(mbs)
    steps = []
    total = epochs * len(mbs)
    for epoch in range(epochs):
        for mb, p in zip(mbs, prox):
            steps.append(update(mb, p, len(steps) + 1 == total))
    return combine_metrics(steps, per_epoch=len(mbs))


_SUMMED = ("skipped", "step_s")


def combine_metrics(steps: list[dict[str, float]], *, per_epoch: int) -> dict[str, float]:
    """One batch's metrics from its optimizer steps' (module docstring): means, but ``tokens`` summed over one
    epoch, ``skipped`` and ``step_s`` summed, ``nonfinite`` if any step's loss was, ``updates`` the count."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for s in steps for k in s):
        values = [s[key] for s in steps if key in s]
        if key == "tokens":
            out[key] = float(sum(s.get(key, 0.0) for s in steps[:per_epoch]))
        elif key in _SUMMED:
            out[key] = float(sum(values))
        elif key == "nonfinite":
            out[key] = max(values)
        else:
            out[key] = float(sum(values) / len(values))
    out["updates"] = float(len(steps))
    return out
