"""Pure bookkeeping of the generator's intake: which offsets may be committed, and when to stop taking prompts.

``OffsetTracker``: prompts of one partition finish out of order (concurrent generation), but a Kafka commit means
"everything before this offset is done". The tracker records each offset when taken and when done, and
``committable()`` returns, per partition, the next offset after the longest *contiguous* completed prefix, once
it moved past what was last committed. A generator killed mid-prompt therefore never commits past an unfinished
prompt: another generator of the group gets it again (at-least-once; episode ids are deterministic, so the
buffer deduplicates what was produced twice).

``Backpressure``: the generator takes a new prompt only while

* ``latest - engine_version <= max_policy_lag``: its weights are at most ``max_policy_lag`` versions older than
  the newest published PolicyVersion (episodes from older weights would be dropped as stale by the buffer). It
  resumes when the weight receiver loads a newer version.
* and, when ``groups_per_version > 0`` (this generator's share of the groups the trainer consumes per version),
  ``taken < (latest - first + max_policy_lag + 1) * groups_per_version + granted``, where ``taken`` counts every
  prompt this generator took and ``first`` is the first version it saw published: it runs at most
  ``max_policy_lag`` versions *ahead* of the trainer (AReaL-style staleness control) and resumes when the trainer
  publishes the next version. Liveness guard: if the buffer drops groups (zero variance, stale), the trainer may
  need more groups than the quota lets through and would wait forever; so when the quota blocked intake for
  ``stall_s()`` with nothing in flight and no new version, ``grant()`` adds one more version's worth. ``stall_s()``
  is the configured ``backpressure_stall_s``, or, when that is 0, three times the mean interval between the last
  published versions (at least 2 s; 10 s before two versions were seen): a guard that scales with the step time.
* A group the buffer will drop for zero variance (every reward equal) trains nothing; with
  ``count_zero_variance=False`` the generator gives its quota back (``refund()``) once it has scored it, so the
  quota counts the groups that can train.

Before any version is published (``latest`` is None) nothing is throttled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Partition:
    committed: int  # next offset to read, as last committed (or -1: unknown, nothing committed by us)
    pending: set[int] = field(default_factory=set)  # taken, not yet done
    done: set[int] = field(default_factory=set)  # done, not yet part of the committed prefix
    low: int = -1  # smallest offset taken since the last commit point
    last: int = -1  # largest offset taken (records arrive in offset order per partition)


class OffsetTracker:
    """Per-partition contiguous-completion tracking; keys are any hashable partition ids (e.g. TopicPartition)."""

    def __init__(self) -> None:
        self._parts: dict[object, _Partition] = {}

    def take(self, tp: object, offset: int) -> None:
        part = self._parts.get(tp)
        if part is None:
            part = self._parts[tp] = _Partition(committed=-1)
        if part.committed >= 0 and offset < part.committed:
            return  # a redelivery of something already committed: nothing to track
        if 0 <= part.last < offset - 1:  # offsets the broker skipped (compaction, control records): nothing to do
            part.done.update(range(part.last + 1, offset))
        part.last = max(part.last, offset)
        part.pending.add(offset)
        if part.low < 0 or offset < part.low:
            part.low = offset

    def done(self, tp: object, offset: int) -> None:
        part = self._parts.get(tp)
        if part is None or offset not in part.pending:
            return  # partition revoked meanwhile, or already committed
        part.pending.discard(offset)
        part.done.add(offset)

    def committable(self) -> dict[object, int]:
        """``{tp: next_offset}`` for partitions whose contiguous done-prefix advanced (not yet committed)."""
        out = {}
        for tp, part in self._parts.items():
            if part.low < 0:
                continue
            nxt = max(part.committed, part.low)
            while nxt in part.done:
                nxt += 1
            if nxt > max(part.committed, part.low):
                out[tp] = nxt
        return out

    def committed(self, offsets: dict[object, int]) -> None:
        """Record a successful commit of ``offsets`` (from ``committable()``)."""
        for tp, nxt in offsets.items():
            part = self._parts.get(tp)
            if part is None:
                continue
            part.committed = nxt
            part.done = {o for o in part.done if o >= nxt}
            part.pending = {o for o in part.pending if o >= nxt}
            remaining = part.pending | part.done
            part.low = min(remaining) if remaining else nxt

    def forget(self, tps: object) -> None:
        """Drop partitions (revoked in a rebalance): their unfinished prompts belong to the new owner."""
        for tp in list(tps):  # type: ignore[call-overload]
            self._parts.pop(tp, None)

    def in_flight(self) -> int:
        return sum(len(p.pending) for p in self._parts.values())

    def pending(self, tp: object) -> set[int]:
        part = self._parts.get(tp)
        return set(part.pending) if part else set()


@dataclass(slots=True)
class Backpressure:
    """See the module docstring. ``open`` says whether the generator may take another prompt now."""

    max_policy_lag: int
    groups_per_version: int = 0
    stall_s_config: float = 0.0  # 0 = adaptive (module docstring)
    count_zero_variance: bool = True
    latest: int | None = None  # newest published version, None before the first
    first: int | None = None  # first version seen published
    taken: int = 0  # prompts taken by this generator since it started (less the refunds)
    granted: int = 0  # extra prompts granted by the liveness guard
    refunded: int = 0  # zero-variance groups given back
    _seen_at: deque[float] = field(default_factory=lambda: deque(maxlen=6))  # when the last versions arrived

    def published(self, version: int, now: float | None = None) -> None:
        if self.first is None:
            self.first = version
        if self.latest is None or version > self.latest:
            self.latest = version
            if now is not None:
                self._seen_at.append(now)

    def took(self, n: int = 1) -> None:
        self.taken += n

    def scored(self, rewards: list[float]) -> None:
        """A group of this generator was scored: give its quota back if it cannot train (zero variance)."""
        if not self.count_zero_variance and (len(rewards) < 2 or max(rewards) - min(rewards) <= 1e-9):
            self.taken -= 1
            self.refunded += 1

    def stall_s(self) -> float:
        """How long the quota may block intake, with nothing in flight, before ``grant()`` (module docstring)."""
        if self.stall_s_config > 0:
            return self.stall_s_config
        seen = list(self._seen_at)
        if len(seen) < 2:
            return 10.0
        return max(2.0, 3.0 * (seen[-1] - seen[0]) / (len(seen) - 1))

    def quota(self) -> int | None:
        """Prompts this generator may have taken by now (None: unlimited)."""
        if self.groups_per_version <= 0 or self.latest is None or self.first is None:
            return None
        return (self.latest - self.first + self.max_policy_lag + 1) * self.groups_per_version + self.granted

    def behind(self, engine_version: int) -> bool:
        return self.latest is not None and self.latest - engine_version > self.max_policy_lag

    def ahead(self) -> bool:
        quota = self.quota()
        return quota is not None and self.taken >= quota

    def open(self, engine_version: int) -> bool:
        return not self.behind(engine_version) and not self.ahead()

    def grant(self) -> None:
        """Liveness guard: allow one more version's worth of prompts (see the module docstring)."""
        self.granted += self.groups_per_version

    def reason(self, engine_version: int) -> str:
        if self.behind(engine_version):
            return f"weights at version {engine_version}, latest {self.latest} (lag > {self.max_policy_lag})"
        if self.ahead():
            return f"{self.taken} prompts taken, quota {self.quota()} at version {self.latest} (ahead of the trainer)"
        return ""
