"""Offset gaps in an ``episodes`` partition: read them again before committing past them.

The buffer commits a partition's offset up to the lowest record it still holds, else one past the highest it has
seen (``BufferState.committable``). A record it never received but whose successors it did is therefore committed
past, and lost. ``episodes`` is never compacted and streamforge writes it without transactions, so its offsets are
contiguous: a record whose offset is beyond the next one expected means the consumer did not get the ones between
(seen once with Tansu at 256 simulated generators: two records of one group never reached the buffer while every
record around them did; bench/RESULTS.md).

``GapGuard.check(partition, offset, expected, now)`` answers ``"ok"`` (no gap), ``"seek"`` (a gap: the caller seeks
the partition back to ``expected`` and drops the rest of this fetch for it; duplicates of what it already has are
deduplicated by the state) or ``"skip"`` (the same gap for longer than ``wait_s``: the records are not there, as
with a compacted topic or transaction markers on a real Kafka; go on past them, counted). Counters:
``offset_gaps`` (gaps seen), ``offset_gap_seeks`` (re-reads), ``offset_gaps_skipped``.
"""

from __future__ import annotations

from typing import Literal

Verdict = Literal["ok", "seek", "skip"]


class GapGuard:
    """Per partition, the gap being re-read (its first missing offset and when it was first seen)."""

    def __init__(self, *, wait_s: float = 5.0, counters: dict[str, int] | None = None) -> None:
        self.wait_s = wait_s
        self._open: dict[int, tuple[int, float]] = {}
        self.counters = counters if counters is not None else {}  # the role's counters, updated in place
        for key in ("offset_gaps", "offset_gap_seeks", "offset_gaps_skipped"):
            self.counters.setdefault(key, 0)

    def check(self, partition: int, offset: int, expected: int | None, now: float) -> Verdict:
        """``expected``: one past the highest offset this buffer has seen in the partition since it was assigned
        (None before the first record: the consumer's starting position is not a gap)."""
        if expected is None or offset <= expected:
            if expected is not None and offset == expected:
                self._open.pop(partition, None)  # the gap (if any) is filled
            return "ok"
        gap = self._open.get(partition)
        if gap is None or gap[0] != expected:
            gap = self._open[partition] = (expected, now)
            self.counters["offset_gaps"] += 1
        if now - gap[1] < self.wait_s:
            self.counters["offset_gap_seeks"] += 1
            return "seek"
        del self._open[partition]
        self.counters["offset_gaps_skipped"] += 1
        return "skip"

    def forget(self, partitions: set[int] | frozenset[int]) -> None:
        """Revoked partitions: their gaps are the next owner's."""
        for p in partitions:
            self._open.pop(p, None)
