"""Offset gaps in an ``episodes`` partition: never committed past, read again until the records arrive.

The buffer commits a partition's offset up to the lowest record it still holds, else one past the highest it has
accepted (``BufferState.committable``). A record it never received but whose successors it accepted would
therefore be committed past, and lost. ``episodes`` is never compacted and streamforge writes it without
transactions, so its offsets are contiguous: a record beyond the next offset expected means the consumer did not
get the ones between.

Why that happens: the embedded broker (Tansu 0.6.0, ``memory://`` and ``s3://`` alike) reserves a produce
request's offsets by advancing the partition's high-water mark before it writes the record batch, and a fetch
serves the batches written below the high-water mark. While one producer connection's batch is not written yet, a
concurrent one's later batch is served, and a Kafka client accepts records beyond the offset it asked for (as
compaction leaves on a real Kafka): it steps over the hole. The records are written a moment later; a fetch from
the hole then returns them (``bench/tansu_gaps.py`` reproduces it without streamforge code; bench/RESULTS.md).

``GapGuard`` keeps, per partition, the next offset expected: ``start(partition, offset)`` when the partition is
assigned (the offset the consumer was positioned at: the committed one, or the log's start), then one past each
record accepted. ``check(partition, offset, now)`` answers:

* ``"ok"``: the next expected record; accept it (a gap open at it is healed);
* ``"old"``: below the next expected (received before; a client resets its position backwards only when the
  log no longer holds it): handle it, the state deduplicates by episode id;
* ``"seek"``: beyond it, a gap: drop the rest of this fetch for the partition and seek it back to
  ``expected(partition)``. Nothing is ever skipped: the partition stays behind the gap, so its commit does too
  (``limit`` caps any commit at the next expected offset). The first re-read of a gap is at once (the broker's
  race heals within milliseconds); if the same gap comes back, ``hold_until(partition)`` says until when the
  partition should wait (paused) before the next re-read, doubling from ``retry_min_s`` to ``retry_max_s``.

A gap open for ``fail_after_s`` or longer is *failing* (``failing(now)``: partition, first missing offset, since
when): the role reports its health as failing, naming them, and keeps re-reading and holding the commit; it is
healthy again when the record arrives.

``GapReader`` carries the verdicts out on the consumer (seek, pause, resume) and reports the health: an error in
the log when it turns failing and at every report while it stays so, a warning when it is healthy again, and the
file ``<run_dir>/health-<buffer_id>.json`` (``{"role", "id", "state": "ok" | "failing", "reason", "gaps":
[{"partition", "offset", "open_s"}], "updated_at"}``) written at start and at each of those.

Counters (the role's, updated in place): ``offset_gaps`` (gaps opened), ``offset_gap_seeks`` (re-reads),
``offset_gaps_healed`` (gaps whose record arrived), ``offset_gaps_failing`` (gaps that lasted ``fail_after_s``),
``offset_gap_heal_ms_max`` (the longest a healed gap stayed open), ``offset_gaps_skipped`` (always 0: no gap is
skipped; kept for readers of the name).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from topics.kafka import TopicPartition

log = logging.getLogger("streamforge.buffer")

Verdict = Literal["ok", "old", "seek"]
COUNTERS = ("offset_gaps", "offset_gap_seeks", "offset_gaps_healed", "offset_gaps_failing", "offset_gap_heal_ms_max",
            "offset_gaps_skipped")


@dataclass(slots=True)
class Gap:
    """An open gap: ``offset`` (the first missing one) never arrived in ``partition`` since ``since``."""

    partition: int
    offset: int
    since: float
    seeks: int = 0
    retry_at: float = 0.0  # the partition waits until then before the next re-read
    failing: bool = False

    def describe(self, now: float) -> str:
        return (f"episodes partition {self.partition}: offset {self.offset} not received for {now - self.since:.1f} s "
                f"({self.seeks} re-reads); offsets committed up to {self.offset} only")


class GapGuard:
    """Per partition, the next offset expected and the gap being re-read (module docstring)."""

    def __init__(self, *, fail_after_s: float = 10.0, retry_min_s: float = 0.01, retry_max_s: float = 1.0,
                 counters: dict[str, int] | None = None) -> None:
        if fail_after_s <= 0 or not 0 < retry_min_s <= retry_max_s:
            raise ValueError("GapGuard: fail_after_s > 0 and 0 < retry_min_s <= retry_max_s")
        self.fail_after_s = fail_after_s
        self.retry_min_s, self.retry_max_s = retry_min_s, retry_max_s
        self._next: dict[int, int] = {}
        self._open: dict[int, Gap] = {}
        self.counters = counters if counters is not None else {}  # the role's counters, updated in place
        for key in COUNTERS:
            self.counters.setdefault(key, 0)

    # -- positions ----------------------------------------------------------------------------
    def start(self, partition: int, offset: int) -> None:
        """The partition was assigned with the consumer at ``offset``: the first record expected."""
        self._next[partition] = offset
        self._open.pop(partition, None)

    def started(self, partition: int) -> bool:
        return partition in self._next

    def expected(self, partition: int) -> int:
        return self._next[partition]

    def limit(self, partition: int, offset: int) -> int:
        """``offset`` (a commit), never beyond the first offset of ``partition`` not received yet."""
        nxt = self._next.get(partition)
        return offset if nxt is None else min(offset, nxt)

    def forget(self, partitions: set[int] | frozenset[int]) -> None:
        """Revoked partitions: their positions and gaps are the next owner's."""
        for p in partitions:
            self._next.pop(p, None)
            self._open.pop(p, None)

    # -- records ------------------------------------------------------------------------------
    def check(self, partition: int, offset: int, now: float) -> Verdict:
        """The verdict on the record at ``offset`` (module docstring); ``start`` must have been called."""
        expected = self._next[partition]
        if offset < expected:
            return "old"
        if offset == expected:
            self._next[partition] = offset + 1
            gap = self._open.pop(partition, None)
            if gap is not None:
                self.counters["offset_gaps_healed"] += 1
                heal_ms = int(1000 * (now - gap.since))
                self.counters["offset_gap_heal_ms_max"] = max(self.counters["offset_gap_heal_ms_max"], heal_ms)
            return "ok"
        gap = self._open.get(partition)
        if gap is None:
            gap = self._open[partition] = Gap(partition, expected, now)
            self.counters["offset_gaps"] += 1
        else:  # the same gap again: wait before the next re-read, longer each time
            gap.retry_at = now + min(self.retry_max_s, self.retry_min_s * 2.0 ** min(gap.seeks - 1, 40))
        gap.seeks += 1
        self.counters["offset_gap_seeks"] += 1
        return "seek"

    def hold_until(self, partition: int) -> float:
        """When the partition's next re-read of its open gap is due (0.0: at once, or no gap)."""
        gap = self._open.get(partition)
        return gap.retry_at if gap is not None else 0.0

    # -- health -------------------------------------------------------------------------------
    def failing(self, now: float) -> list[Gap]:
        """The gaps open ``fail_after_s`` or longer (each counted once in ``offset_gaps_failing``)."""
        out = []
        for gap in self._open.values():
            if now - gap.since >= self.fail_after_s:
                if not gap.failing:
                    gap.failing = True
                    self.counters["offset_gaps_failing"] += 1
                out.append(gap)
        return out

    @property
    def open_gaps(self) -> list[Gap]:
        return list(self._open.values())


class GapReader:
    """``GapGuard`` carried out on the ``episodes`` consumer (a ``topics.kafka.Consumer``, passed to each call):
    partitions put at their start when assigned, seeks back and pauses on a gap, resumes when a re-read is due,
    and the role's health said in the log and written to ``health_path`` when it changes (again with ``again``).
    """

    def __init__(self, guard: GapGuard, *, topic: str, health_path: Path, buffer_id: str) -> None:
        self.guard = guard
        self.topic = topic
        self.health_path = health_path
        self.buffer_id = buffer_id
        self.who = f"buffer {buffer_id}"  # for the log
        self.waiting: set[int] = set()  # partitions paused until their gap's next re-read is due
        self.failing: str | None = None  # why the health is failing ("" = healthy, None = not said yet)
        self._rewound: set[int] = set()  # partitions read again from a gap in this fetch
        self._early: set[int] = set()  # partitions whose records came before their start: seeked back to it

    def _tp(self, partition: int) -> TopicPartition:
        return TopicPartition(self.topic, partition)

    async def start(self, consumer: Any, committed: dict[TopicPartition, int | None]) -> None:
        """Assigned partitions: each one's first record is expected where the consumer starts it, at its committed
        offset, else at the log's start, so a gap right at the start is one too. A partition whose records were
        fetched (and dropped) before this is put back there."""
        starts = dict(committed)
        fresh = [tp for tp, off in committed.items() if off is None]
        if fresh:
            starts.update(await consumer.beginning_offsets(fresh))
        for tp, off in starts.items():
            self.guard.start(tp.partition, off)
            if tp.partition in self._early:
                self._early.discard(tp.partition)
                consumer.seek(tp, off)

    def forget(self, partitions: set[int]) -> None:
        self.guard.forget(partitions)
        self.waiting -= partitions
        self._early -= partitions

    def new_fetch(self) -> None:
        self._rewound.clear()

    def accept(self, consumer: Any, partition: int, offset: int, now: float) -> bool:
        """Whether to handle the record (the next expected one, or one received before). Else it is dropped: of a
        partition not started yet (``start`` puts it back), or beyond a gap (the partition is read again from the
        gap, after its pause; the rest of this fetch for it is dropped too)."""
        if partition in self._rewound:
            return False
        if not self.guard.started(partition):
            self.guard.counters["discarded_before_assign"] = self.guard.counters.get("discarded_before_assign", 0) + 1
            self._early.add(partition)
            return False
        if self.guard.check(partition, offset, now) != "seek":
            return True
        expected = self.guard.expected(partition)
        consumer.seek(self._tp(partition), expected)
        self._rewound.add(partition)
        if self.guard.hold_until(partition) > now:
            consumer.pause(self._tp(partition))
            self.waiting.add(partition)
        log.debug("%s: %s partition %d: offset %d came before %d; reading again from there", self.who, self.topic,
                  partition, offset, expected)
        return False

    def next_resume(self) -> float | None:
        """When the first paused partition's re-read is due; None when none waits."""
        return min((self.guard.hold_until(p) for p in self.waiting), default=None)

    def resume_due(self, consumer: Any, now: float, *, paused: bool) -> None:
        """Resume the partitions whose re-read is due, unless consumption is ``paused`` as a whole."""
        due = {p for p in self.waiting if self.guard.hold_until(p) <= now}
        self.waiting -= due
        if due and not paused:
            consumer.resume(*(self._tp(p) for p in sorted(due)))

    def health(self, now: float) -> dict[str, Any]:
        """``{"state": "ok" | "failing", "reason": ..., "gaps": [{"partition", "offset", "open_s"}]}``."""
        failing = self.guard.failing(now)
        return {"state": "failing" if failing else "ok", "reason": "; ".join(g.describe(now) for g in failing),
                "gaps": [{"partition": g.partition, "offset": g.offset, "open_s": round(now - g.since, 3)}
                         for g in failing]}

    def check_health(self, now: float, *, again: bool = False) -> dict[str, Any]:
        """The health now; a change is logged (an error naming partition and offset, or healthy again) and written
        to ``health_path``, and so is a failing health ``again``."""
        health = self.health(now)
        reason = health["reason"]
        changed = self.failing is None or bool(reason) != bool(self.failing)
        was, self.failing = self.failing, reason
        if reason and (changed or again):
            log.error("%s: health failing: %s", self.who, reason)
        elif changed and was is not None:
            log.warning("%s: healthy again: the missing records arrived", self.who)
        if changed or (reason and again):
            self._write(health)
        return health

    def _write(self, health: dict[str, Any]) -> None:
        try:
            self.health_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.health_path.with_name(self.health_path.name + ".tmp")
            tmp.write_bytes(orjson.dumps({"role": "buffer", "id": self.buffer_id, **health,
                                          "updated_at": time.time()}))
            tmp.replace(self.health_path)
        except OSError as exc:  # said in the log already; a full disk must not stop the buffer
            log.warning("%s: cannot write %s: %s", self.who, self.health_path, exc)
