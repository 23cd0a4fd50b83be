"""GapGuard (buffer/gaps.py): a record beyond the next expected offset makes the buffer read the partition again
from the gap, until the gap fills or has lasted ``wait_s``; the consumer's starting point is never a gap."""

from __future__ import annotations

from buffer.gaps import GapGuard


def test_no_gap_before_the_first_record_nor_for_replays_and_the_next_offset() -> None:
    guard = GapGuard()
    assert guard.check(0, 5000, None, now=0.0) == "ok"  # the committed position: wherever the consumer starts
    assert guard.check(0, 5001, 5001, now=0.0) == "ok"
    assert guard.check(0, 4990, 5002, now=0.0) == "ok"  # a replay below what was seen
    assert guard.counters == {"offset_gaps": 0, "offset_gap_seeks": 0, "offset_gaps_skipped": 0}


def test_a_gap_is_read_again_until_it_fills() -> None:
    counters = {"dead_lettered": 0}
    guard = GapGuard(wait_s=5.0, counters=counters)
    assert guard.check(1, 5158, 5156, now=10.0) == "seek"  # 5156 and 5157 never arrived
    assert guard.check(1, 5158, 5156, now=10.1) == "seek"  # read again, still beyond: the same gap
    assert guard.check(1, 5156, 5156, now=10.2) == "ok"  # it came: the gap is closed
    assert guard.check(1, 5157, 5157, now=10.2) == "ok"
    assert counters == {"dead_lettered": 0, "offset_gaps": 1, "offset_gap_seeks": 2, "offset_gaps_skipped": 0}
    assert guard.check(0, 9, 7, now=10.3) == "seek"  # partitions are separate
    assert counters["offset_gaps"] == 2


def test_a_gap_that_lasts_is_skipped_once_and_counted() -> None:
    guard = GapGuard(wait_s=5.0)
    assert guard.check(2, 120, 100, now=0.0) == "seek"
    assert guard.check(2, 120, 100, now=4.9) == "seek"
    assert guard.check(2, 120, 100, now=5.0) == "skip"  # not there (compaction, transaction markers): go on
    assert guard.check(2, 121, 121, now=5.1) == "ok"
    assert guard.counters["offset_gaps_skipped"] == 1 and guard.counters["offset_gaps"] == 1
    assert guard.check(2, 130, 122, now=6.0) == "seek"  # a new gap starts its own wait
    assert guard.counters["offset_gaps"] == 2


def test_a_revoked_partition_forgets_its_gap() -> None:
    guard = GapGuard(wait_s=5.0)
    assert guard.check(3, 50, 40, now=0.0) == "seek"
    guard.forget({3})
    assert guard.check(3, 50, 40, now=10.0) == "seek"  # a fresh gap for the next owner, not a skip
    assert guard.counters["offset_gaps"] == 2
