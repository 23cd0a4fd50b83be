"""The buffer's view of the trainer's pace: its published versions and its progress, and what follows from them.

``TrainerPace`` is pure state (no I/O), fed by the buffer role's two KV watches: ``on_version`` with each newer
``PolicyVersion`` (``latest`` key), ``on_progress`` with the trainer's ``TrainerProgress`` (``progress`` key,
written after every step). From them it answers how many batches the trainer has consumed (``consumed``) and, for
the per-batch staleness check (``buffer/state.py`` rule 7), how many versions the trainer will have published by
the time a batch cut now is trained (``future_versions``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

from topics.schemas import PolicyVersion, TrainerProgress


class TrainerPace:
    """The latest version and step the trainer published, the steps it trained, and its recent progress."""

    def __init__(self, pv: PolicyVersion | None = None) -> None:
        self.latest_version: int | None = pv.version if pv is not None else None
        self.trained_steps = pv.step if pv is not None else 0  # its progress, or the latest version's step
        self.published_step = self.trained_steps  # the step of the latest PolicyVersion
        self.progress: TrainerProgress | None = None
        self._seen: collections.deque[tuple[int, int]] = collections.deque(maxlen=20)  # (step, version)

    def on_version(self, pv: PolicyVersion) -> bool:
        """A version read from the store; returns whether it is newer than the latest known."""
        newer = self.latest_version is None or pv.version > self.latest_version
        if newer:
            self.latest_version = pv.version
        self.published_step = max(self.published_step, pv.step)
        return newer

    def on_progress(self, progress: TrainerProgress) -> bool:
        """The trainer's progress; returns whether it consumed more batches than before."""
        consumed_more = self.progress is None or progress.consumed > self.progress.consumed
        if self.progress is not None and progress.step < self.progress.step:  # a restarted trainer
            self._seen.clear()
        self.progress = progress
        self._seen.append((progress.step, progress.version))
        return consumed_more

    def trained(self, step: int) -> bool:
        """The trainer has trained ``step`` steps; returns whether that is news."""
        moved = step > self.trained_steps
        self.trained_steps = max(self.trained_steps, step)
        return moved

    def consumed(self) -> int:
        """Batches the trainer consumed (its progress: trained, refused or skipped alike), else its trained steps."""
        p = self.progress
        return p.consumed if p is not None and p.consumed >= 0 else self.trained_steps

    def future_versions(self, ahead: int) -> tuple[Callable[[int], int], int | None]:
        """``(f, reference)``: the version the trainer trains with now, and ``f(j)``, how many versions it will
        publish before the ``j``-th batch cut now is trained: it trains the ``ahead + j`` batches queued before it,
        plus the steps it trained since its last publication, at the rate of versions per step seen in its recent
        progress (at most one per ``publish_every`` steps; with ``publish_busy: skip`` fewer, as rounds take their
        time), rounded up. An estimate: the trainer enforces the bound itself and refuses a batch that turned out
        too stale. Without the trainer's progress: one version per batch queued, and one owed when its published
        step lags its steps."""
        p = self.progress
        if p is None:
            owed = int(self.trained_steps > self.published_step)
            return (lambda j: ahead + j + owed), self.latest_version
        every = max(1, p.publish_every)
        rate = 1.0 / every
        if len(self._seen) >= 2:
            (s0, v0), (s1, v1) = self._seen[0], self._seen[-1]
            if s1 > s0:
                rate = min(rate, max(0.0, (v1 - v0) / (s1 - s0)))
        unpublished = max(0, p.step - p.published_step)
        reference = max(p.version, self.latest_version if self.latest_version is not None else -1)

        def f(j: int) -> int:
            steps = unpublished + ahead + j
            return min(steps // every, math.ceil(steps * rate - 1e-9))  # the most possible, or the rate seen

        return f, reference
