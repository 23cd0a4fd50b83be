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
* and, when ``groups_per_version > 0``, it has taken fewer than ``(max_policy_lag + 1) * groups_per_version``
  prompts since ``latest`` was published: it runs at most ``max_policy_lag`` versions *ahead* of the trainer and
  resumes when the trainer publishes the next version. Off by default: with filters that drop whole groups (zero
  reward variance) a trainer may need more groups per version than the quota lets through.

Before any version is published (``latest`` is None) nothing is throttled.
"""

from __future__ import annotations

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
            nxt = part.committed if part.committed >= part.low else part.low
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
    latest: int | None = None  # newest published version, None before the first
    taken_since_latest: int = 0

    def published(self, version: int) -> None:
        if self.latest is None or version > self.latest:
            self.latest = version
            self.taken_since_latest = 0

    def took(self, n: int = 1) -> None:
        self.taken_since_latest += n

    def open(self, engine_version: int) -> bool:
        if self.latest is None:
            return True
        if self.latest - engine_version > self.max_policy_lag:
            return False
        if self.groups_per_version > 0:
            return self.taken_since_latest < (self.max_policy_lag + 1) * self.groups_per_version
        return True

    def reason(self, engine_version: int) -> str:
        if self.open(engine_version):
            return ""
        if self.latest is not None and self.latest - engine_version > self.max_policy_lag:
            return f"weights at version {engine_version}, latest {self.latest} (lag > {self.max_policy_lag})"
        return f"{self.taken_since_latest} prompts taken since version {self.latest} was published"
