"""GapGuard and GapReader (buffer/gaps.py): a record beyond the next expected offset makes the buffer read the
partition again from the gap until the record arrives; no gap is ever skipped, a commit never passes one, and a gap
open ``fail_after_s`` turns the health to failing with partition and offset named."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.gaps import GapGuard, GapReader
from topics.kafka import TopicPartition

TOPIC = "run.episodes"


def test_records_from_the_start_are_accepted_in_order_and_earlier_ones_are_old() -> None:
    guard = GapGuard()
    guard.start(0, 5000)  # the committed offset: where the consumer was put
    assert guard.check(0, 5000, now=0.0) == "ok"
    assert guard.check(0, 5001, now=0.0) == "ok"
    assert guard.check(0, 4990, now=0.0) == "old"  # received before (the state deduplicates it)
    assert guard.expected(0) == 5002
    assert guard.counters["offset_gaps"] == 0 and guard.counters["offset_gap_seeks"] == 0


def test_a_gap_at_the_start_is_a_gap() -> None:
    guard = GapGuard()
    guard.start(0, 0)
    assert guard.check(0, 1, now=0.0) == "seek"  # offset 0 was not served yet: not a new starting point
    assert guard.expected(0) == 0 and guard.limit(0, 2) == 0


def test_a_gap_is_read_again_until_it_fills_and_is_never_skipped() -> None:
    counters = {"dead_lettered": 0}
    guard = GapGuard(fail_after_s=10.0, counters=counters)
    guard.start(1, 5150)
    for off in range(5150, 5156):
        assert guard.check(1, off, now=0.0) == "ok"
    assert guard.check(1, 5158, now=10.0) == "seek"  # 5156 and 5157 never arrived
    for t in (10.1, 20.0, 1000.0, 1e6):  # however long it lasts: read again, never passed
        assert guard.check(1, 5158, now=t) == "seek"
        assert guard.limit(1, 5159) == 5156  # a commit stays at the first offset not received
    assert guard.check(1, 5156, now=1e6 + 0.5) == "ok"  # it came: the gap is closed
    assert guard.check(1, 5157, now=1e6 + 0.5) == "ok"
    assert counters["offset_gaps"] == 1 and counters["offset_gap_seeks"] == 5
    assert counters["offset_gaps_healed"] == 1 and counters["offset_gaps_skipped"] == 0
    assert counters["offset_gap_heal_ms_max"] == int(1000 * (1e6 + 0.5 - 10.0))
    assert counters["dead_lettered"] == 0  # the role's own counters are kept


def test_the_first_reread_is_at_once_then_the_partition_waits_longer_each_time() -> None:
    guard = GapGuard(retry_min_s=0.01, retry_max_s=0.05)
    guard.start(0, 10)
    assert guard.check(0, 12, now=1.0) == "seek"
    assert guard.hold_until(0) == 0.0  # at once: the broker's race heals in milliseconds
    waits = []
    for t in (1.001, 2.0, 3.0, 4.0, 5.0):
        guard.check(0, 12, now=t)
        waits.append(round(guard.hold_until(0) - t, 6))
    assert waits == [0.01, 0.02, 0.04, 0.05, 0.05]
    for i in range(5000):  # a hole that never fills: re-read every retry_max_s for ever (no overflow)
        guard.check(0, 12, now=6.0 + i)
    assert guard.hold_until(0) == pytest.approx(6.0 + 4999 + 0.05)
    assert guard.check(0, 10, now=6000.0) == "ok" and guard.hold_until(0) == 0.0


def test_a_gap_open_long_enough_is_failing_naming_partition_and_offset() -> None:
    guard = GapGuard(fail_after_s=5.0)
    guard.start(2, 100)
    guard.check(2, 120, now=0.0)
    assert guard.failing(4.9) == []
    [gap] = guard.failing(5.0)
    assert (gap.partition, gap.offset) == (2, 100)
    assert "partition 2: offset 100 not received for 6.0 s" in gap.describe(6.0)
    guard.failing(7.0)
    assert guard.counters["offset_gaps_failing"] == 1  # counted once per gap
    guard.check(2, 100, now=8.0)
    assert guard.failing(9.0) == []  # healed
    guard.check(2, 130, now=9.0)  # a new gap starts its own clock
    assert guard.failing(13.9) == [] and guard.counters["offset_gaps"] == 2


def test_partitions_are_separate_and_a_revoked_one_is_forgotten() -> None:
    guard = GapGuard()
    guard.start(0, 7)
    guard.start(3, 40)
    assert guard.check(0, 9, now=0.0) == "seek"
    assert guard.check(3, 40, now=0.0) == "ok"
    guard.forget({0})
    assert not guard.started(0) and guard.open_gaps == [] and guard.limit(0, 99) == 99
    guard.start(0, 7)  # the next assignment starts it again, at its committed offset
    assert guard.check(0, 7, now=1.0) == "ok"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="fail_after_s"):
        GapGuard(fail_after_s=0)
    with pytest.raises(ValueError, match="retry_min_s"):
        GapGuard(retry_min_s=1.0, retry_max_s=0.5)


# -- GapReader on a fake consumer ----------------------------------------------------------------------------------
class FakeConsumer:
    """What GapReader calls on topics.kafka.Consumer: seek, pause, resume, beginning_offsets."""

    def __init__(self, log_start: int = 0) -> None:
        self.positions: dict[int, int] = {}
        self.paused: set[int] = set()
        self.log_start = log_start

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.log_start for tp in tps}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp.partition] = offset

    def pause(self, *tps: TopicPartition) -> None:
        self.paused.update(tp.partition for tp in tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused.difference_update(tp.partition for tp in tps)


def reader(tmp_path: Path, **kw: float) -> GapReader:
    return GapReader(GapGuard(counters={}, **kw), topic=TOPIC, health_path=tmp_path / "health-b0.json",
                     buffer_id="b0")


def test_assigned_partitions_expect_the_committed_offset_else_the_log_start(tmp_path: Path) -> None:
    r, consumer = reader(tmp_path), FakeConsumer(log_start=3)
    asyncio.run(r.start(consumer, {TopicPartition(TOPIC, 0): 120, TopicPartition(TOPIC, 1): None}))
    assert r.guard.expected(0) == 120 and r.guard.expected(1) == 3
    assert consumer.positions == {}  # where the consumer starts them itself
    assert r.accept(consumer, 1, 3, now=0.0) and not r.accept(consumer, 0, 121, now=0.0)  # a gap at the start


def test_a_record_before_its_partition_started_is_dropped_and_the_start_puts_it_back(tmp_path: Path) -> None:
    r, consumer = reader(tmp_path), FakeConsumer()
    assert not r.accept(consumer, 5, 40, now=0.0)  # fetched before the assignment's callback ran
    assert r.guard.counters["discarded_before_assign"] == 1 and consumer.positions == {}
    asyncio.run(r.start(consumer, {TopicPartition(TOPIC, 5): 40}))
    assert consumer.positions == {5: 40}  # read again from its start
    assert r.accept(consumer, 5, 40, now=0.1)


def test_a_gap_seeks_back_drops_the_rest_of_the_fetch_and_pauses_when_it_comes_back(tmp_path: Path) -> None:
    r, consumer = reader(tmp_path), FakeConsumer()
    asyncio.run(r.start(consumer, {TopicPartition(TOPIC, 0): 10}))
    r.new_fetch()
    assert [r.accept(consumer, 0, off, now=1.0) for off in (10, 11, 13, 14)] == [True, True, False, False]
    assert consumer.positions[0] == 12 and r.guard.counters["offset_gap_seeks"] == 1  # 14: the same fetch, dropped
    assert consumer.paused == set()  # read again at once
    r.new_fetch()
    assert not r.accept(consumer, 0, 13, now=1.01)  # still missing: now the partition waits before the next read
    assert consumer.paused == {0} and r.waiting == {0} and r.next_resume() == pytest.approx(1.02)
    r.resume_due(consumer, 1.015, paused=False)
    assert consumer.paused == {0}  # not due yet
    r.resume_due(consumer, 1.03, paused=True)  # due, but consumption is paused as a whole: the caller resumes
    assert r.waiting == set() and consumer.paused == {0} and r.next_resume() is None
    r.new_fetch()
    assert not r.accept(consumer, 0, 13, now=1.04)
    r.resume_due(consumer, 2.0, paused=False)
    assert consumer.paused == set()
    r.new_fetch()
    assert [r.accept(consumer, 0, off, now=2.1) for off in (12, 13, 14)] == [True, True, True]
    assert r.guard.counters["offset_gaps_healed"] == 1


def test_health_is_written_at_start_turns_failing_naming_the_gap_and_heals(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    r, consumer = reader(tmp_path, fail_after_s=5.0), FakeConsumer()
    path = tmp_path / "health-b0.json"
    assert r.check_health(0.0)["state"] == "ok"
    assert orjson.loads(path.read_bytes())["state"] == "ok"
    asyncio.run(r.start(consumer, {TopicPartition(TOPIC, 4): 5156}))
    r.new_fetch()
    assert not r.accept(consumer, 4, 5158, now=10.0)
    assert r.check_health(14.0)["state"] == "ok"
    with caplog.at_level("ERROR", logger="streamforge.buffer"):
        health = r.check_health(15.5)
    assert health["state"] == "failing" and health["gaps"] == [{"partition": 4, "offset": 5156, "open_s": 5.5}]
    assert "partition 4: offset 5156 not received" in health["reason"]
    assert "offsets committed up to 5156 only" in health["reason"]
    assert "health failing: episodes partition 4: offset 5156" in caplog.text
    written = orjson.loads(path.read_bytes())
    assert written["state"] == "failing" and written["id"] == "b0" and written["gaps"][0]["offset"] == 5156
    caplog.clear()
    with caplog.at_level("ERROR", logger="streamforge.buffer"):
        r.check_health(16.0)  # no change: said again only at a report
        assert caplog.text == ""
        r.check_health(20.0, again=True)
        assert "not received for 10.0 s" in caplog.text
    r.new_fetch()
    assert r.accept(consumer, 4, 5156, now=21.0)
    assert r.check_health(21.0)["state"] == "ok" and orjson.loads(path.read_bytes())["state"] == "ok"


# -- the property: whatever the broker hides for a while, nothing is skipped ---------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 300), st.floats(0.0, 0.5))
def test_accepted_offsets_are_contiguous_and_commits_never_pass_a_missing_one(seed: int, n: int,
                                                                             hidden: float) -> None:
    """A partition of ``n`` records where each is hidden from fetches for a random number of them (a produce
    written late): the records accepted are exactly start, start+1, ... and every commit limit is at most one past
    the highest accepted."""
    rng = random.Random(seed)
    visible_after = [rng.randrange(1, 6) if rng.random() < hidden else 0 for _ in range(n)]
    r = GapReader(GapGuard(counters={}), topic=TOPIC, health_path=Path("/nonexistent/h.json"), buffer_id="p")
    consumer = FakeConsumer()
    consumer.positions[0] = 0  # the consumer starts at the log's start
    asyncio.run(r.start(consumer, {TopicPartition(TOPIC, 0): None}))
    accepted: list[int] = []
    for fetch in range(20 * n + 50):
        if len(accepted) == n:
            break
        pos = consumer.positions[0]
        served = [o for o in range(pos, min(n, pos + rng.randrange(1, 8))) if visible_after[o] <= fetch]
        r.new_fetch()
        for off in served:
            if r.accept(consumer, 0, off, now=float(fetch)):
                accepted.append(off)
                consumer.positions[0] = off + 1
        assert r.guard.limit(0, 10**9) == (accepted[-1] + 1 if accepted else 0)
        r.resume_due(consumer, float(fetch) + 1.0, paused=False)
    assert accepted == list(range(n))
    assert r.guard.counters["offset_gaps_skipped"] == 0


def test_status_lists_each_buffers_health_from_its_file(tmp_path: Path) -> None:
    from streamforge.status import buffer_health

    assert buffer_health(tmp_path) is None
    r, consumer = reader(tmp_path, fail_after_s=1.0), FakeConsumer()
    r.check_health(0.0)
    assert buffer_health(tmp_path) == {"b0": {"state": "ok", "reason": "", "gaps": [], "updated_at": pytest.approx(
        orjson.loads((tmp_path / "health-b0.json").read_bytes())["updated_at"])}}
    asyncio.run(r.start(consumer, {TopicPartition(TOPIC, 0): 7}))
    r.accept(consumer, 0, 9, now=1.0)
    r.check_health(3.0)
    (tmp_path / "health-other.json").write_bytes(b"{not json")  # skipped, as a file being replaced would be
    [(bid, row)] = buffer_health(tmp_path).items()
    assert bid == "b0" and row["state"] == "failing" and row["gaps"] == [{"partition": 0, "offset": 7, "open_s": 2.0}]


def test_a_bad_gap_bound_fails_at_start_up_naming_the_key() -> None:
    from buffer.config import BufferConfig
    from topics.errors import ConfigError

    assert BufferConfig().offset_gap_fail_s == 10.0
    with pytest.raises(ConfigError, match="buffer.offset_gap_fail_s"):
        BufferConfig(offset_gap_fail_s=0)
