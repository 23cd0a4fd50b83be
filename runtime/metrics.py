"""Metrics any role can record: ``record_metric(key, value, reduce)`` and ``flush_metrics(step)``.

Keys are hierarchical (``buffer/dropped/stale``, ``generator/tokens_per_s``). Values recorded between two
flushes are reduced with ``mean``, ``sum``, ``max``, ``min`` or ``std``. Backends, chosen by
``telemetry.metrics``: ``console`` (a log line), ``jsonl`` (``<run_dir>/metrics-<role>.jsonl``), ``tensorboard``
(TensorBoard event files under ``<run_dir>/tb/<role>``) and ``wandb`` (one W&B run per role process in the project
``telemetry.wandb_project``, grouped by the run directory's name, its files under ``<run_dir>/wandb``;
``WANDB_MODE=offline`` works without a network). Both trackers are the ``trackers`` extra; a backend whose package
is missing is skipped with a warning. ``close()`` (``close_metrics()``, called when a role process ends) closes the
event file and finishes the W&B run. The trainer's per-step ``<run_dir>/metrics.jsonl`` is its own contract,
written by the trainer.
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

    def __init__(self, role: str = "", run_dir: str | Path | None = None, backends: Sequence[str] = (), *,
                 wandb_project: str = "streamforge", run_config: dict[str, Any] | None = None) -> None:
        self.role = role
        self.run_dir = Path(run_dir) if run_dir else None
        self.wandb_project = wandb_project
        self.run_config = run_config or {}
        self._values: dict[str, list[float]] = defaultdict(list)
        self._reduce: dict[str, str] = {}
        self._sinks: list[Any] = []
        self._closers: list[Any] = []
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
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # torch's writer needs the tensorboard package
                log.warning("metrics backend tensorboard requested but tensorboard is not installed "
                            "(pip install 'streamforge[trackers]'); skipping it")
                return
            writer = SummaryWriter(str((self.run_dir or Path(".")) / "tb" / (self.role or "role")))

            def add(step: int, row: dict[str, float]) -> None:
                for k, v in row.items():
                    writer.add_scalar(k, v, step)
                writer.flush()

            self._sinks.append(add)
            self._closers.append(writer.close)
        elif backend == "wandb":
            try:
                import wandb
            except ImportError:
                log.warning("metrics backend wandb requested but wandb is not installed "
                            "(pip install 'streamforge[trackers]'); skipping it")
                return
            run_dir = self.run_dir or Path(".")
            (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
            run = wandb.init(project=self.wandb_project, group=run_dir.resolve().name, name=self.role or "role",
                             job_type=(self.role or "role").split("-")[0], dir=str(run_dir),
                             config=self.run_config, reinit="create_new")
            self._sinks.append(lambda step, row: run.log(row, step=step))
            self._closers.append(run.finish)
        else:
            raise ValueError(f"unknown metrics backend {backend!r}")

    def record(self, key: str, value: float, reduce: str = "mean") -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"unknown reduction {reduce!r}; use one of {REDUCTIONS}")
        self._reduce[key] = reduce
        self._values[key].append(float(value))

    def close(self) -> None:
        """Close every backend (the event file, the W&B run); safe to call twice."""
        closers, self._closers = self._closers, []
        for close in closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - closing one backend must not stop the others
                log.warning("closing a metrics backend: %s", exc)

    def flush(self, step: int) -> dict[str, float]:
        """Reduce what was recorded since the last flush, send it to every backend, and return it."""
        row = {k: reduce_values(v, self._reduce[k]) for k, v in self._values.items() if v}
        self._values.clear()
        if row:
            for sink in self._sinks:
                sink(step, row)
        return row


_default = MetricsLogger()


def configure_metrics(role: str, run_dir: str | Path | None, backends: Sequence[str], *,
                      wandb_project: str = "streamforge", run_config: dict[str, Any] | None = None) -> MetricsLogger:
    """Install the process-wide metrics logger used by ``record_metric`` (closing the one it replaces)."""
    global _default
    _default.close()
    _default = MetricsLogger(role, run_dir, backends, wandb_project=wandb_project, run_config=run_config)
    return _default


def close_metrics() -> None:
    """Close the process-wide logger's backends (a role process calls it once, when it ends)."""
    _default.close()


def record_metric(key: str, value: float, reduce: str = "mean") -> None:
    _default.record(key, value, reduce)


def flush_metrics(step: int) -> dict[str, float]:
    return _default.flush(step)
