"""Losses for the tests, importable by trainer processes (``tests/`` on their ``PYTHONPATH``)."""

from __future__ import annotations

import time
from typing import Any

from consumers.losses import make_loss


def slow_grpo(delay_s: float = 0.3, **hyperparams: Any):
    """The built-in ``grpo`` loss, ``delay_s`` slower a step: a trainer slower than its generator."""
    inner = make_loss("grpo", **hyperparams)

    def loss_fn(logprobs, old_logprobs, advantages, mask, ref_logprobs=None, **extra):
        time.sleep(delay_s)
        return inner(logprobs, old_logprobs, advantages, mask, ref_logprobs, **extra)

    if hasattr(inner, "aggregation"):
        loss_fn.aggregation = inner.aggregation
    return loss_fn


def fail_once_at(calls: int = 10, marker: str = "", **hyperparams: Any):
    """The built-in ``grpo`` loss that raises on its ``calls``-th call, once per ``marker`` file (a trainer whose
    training loop fails; after a restart the marker is there and it trains on)."""
    from pathlib import Path

    inner = make_loss("grpo", **hyperparams)
    seen = {"n": 0}

    def loss_fn(logprobs, old_logprobs, advantages, mask, ref_logprobs=None, **extra):
        seen["n"] += 1
        if seen["n"] == calls and marker and not Path(marker).exists():
            Path(marker).write_text("failed once")
            raise RuntimeError(f"injected failure at loss call {calls}")
        return inner(logprobs, old_logprobs, advantages, mask, ref_logprobs, **extra)

    if hasattr(inner, "aggregation"):
        loss_fn.aggregation = inner.aggregation
    return loss_fn
