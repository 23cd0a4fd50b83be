"""Metrics any role can record: ``record_metric(key, value, reduce)`` and ``flush_metrics(step)``.

Keys are hierarchical (``buffer/dropped/stale``, ``generator/tokens_per_s``). Values recorded between two
flushes are reduced with ``mean``, ``sum``, ``max``, ``min`` or ``std``. Backends, chosen by
``telemetry.metrics``: ``console`` (a log line), ``jsonl`` (``<run_dir>/metrics-<role>.jsonl``), ``tensorboard``
(``<run_dir>/tb/<role>``) and ``wandb`` (optional import). The trainer's per-step ``<run_dir>/metrics.jsonl`` is
its own contract, written by the trainer.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("streamforge.metrics")

REDUCTIONS = ("mean", "sum", "max", "min", "std")


def reduce_values(values: Sequence[float], how: str) -> float:
    if how == "mean":
        return sum(values) / len(values)
    if how == "sum":
        return float(sum(values))
    if how == "max":
        return float(max(values))
    if how == "min":
        return float(min(values))
    if how == "std":
        mean = sum(values) / len(values)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    raise ValueError(f"unknown reduction {how!r}; use one of {REDUCTIONS}")


class MetricsLogger:
    """Accumulates values per key and writes reduced values to the configured backends on ``flush``."""

    def __init__(self, role: str = "", run_dir: str | Path | None = None, backends: Sequence[str] = ()) -> None:
        self.role = role
        self.run_dir = Path(run_dir) if run_dir else None
        self._values: dict[str, list[float]] = defaultdict(list)
        self._reduce: dict[str, str] = {}
        self._sinks: list[Any] = []
        self._start = time.time()
        for backend in backends:
            self._add_backend(backend)

    def _add_backend(self, backend: str) -> None:
        if backend == "console":
            self._sinks.append(lambda step, row: log.info("%s step %s: %s", self.role, step, row))
        elif backend == "jsonl":
            if self.run_dir is None:
                return
            path = self.run_dir / f"metrics-{self.role or 'role'}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)

            def write(step: int, row: dict[str, float], path: Path = path) -> None:
                with open(path, "ab") as fh:
                    fh.write(orjson.dumps({"step": step, "time_s": time.time() - self._start, **row}) + b"\n")

            self._sinks.append(write)
        elif backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str((self.run_dir or Path(".")) / "tb" / (self.role or "role")))
            self._sinks.append(lambda step, row: [writer.add_scalar(k, v, step) for k, v in row.items()])
        elif backend == "wandb":
            try:
                import wandb
            except ImportError:
                log.warning("metrics backend wandb requested but wandb is not installed; skipping it")
                return
            self._sinks.append(lambda step, row: wandb.log(row, step=step))
        else:
            raise ValueError(f"unknown metrics backend {backend!r}")

    def record(self, key: str, value: float, reduce: str = "mean") -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"unknown reduction {reduce!r}; use one of {REDUCTIONS}")
        self._reduce[key] = reduce
        self._values[key].append(float(value))

    def flush(self, step: int) -> dict[str, float]:
        """Reduce what was recorded since the last flush, send it to every backend, and return it."""
        row = {k: reduce_values(v, self._reduce[k]) for k, v in self._values.items() if v}
        self._values.clear()
        if row:
            for sink in self._sinks:
                sink(step, row)
        return row


_default = MetricsLogger()


def configure_metrics(role: str, run_dir: str | Path | None, backends: Sequence[str]) -> MetricsLogger:
    """Install the process-wide metrics logger used by ``record_metric``."""
    global _default
    _default = MetricsLogger(role, run_dir, backends)
    return _default


def record_metric(key: str, value: float, reduce: str = "mean") -> None:
    _default.record(key, value, reduce)


def flush_metrics(step: int) -> dict[str, float]:
    return _default.flush(step)
