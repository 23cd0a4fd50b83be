"""The generator's commit and backpressure rules (producers/flow.py), without brokers."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from producers.flow import Backpressure, OffsetTracker


def test_commits_only_the_contiguous_completed_prefix():
    t = OffsetTracker()
    for o in (5, 6, 7, 8):
        t.take("p0", o)
    t.done("p0", 6)
    t.done("p0", 8)
    assert t.committable() == {}  # 5 still running
    t.done("p0", 5)
    assert t.committable() == {"p0": 7}
    t.committed({"p0": 7})
    assert t.committable() == {}
    t.done("p0", 7)
    assert t.committable() == {"p0": 9}
    t.committed({"p0": 9})
    assert t.in_flight() == 0 and t.committable() == {}


def test_partitions_are_independent_and_revoked_ones_forgotten():
    t = OffsetTracker()
    t.take("a", 0)
    t.take("b", 10)
    t.done("b", 10)
    assert t.committable() == {"b": 11}
    t.forget(["a"])
    t.done("a", 0)  # finished after the revoke: ignored, the new owner redoes it
    assert "a" not in t.committable()


def test_gaps_left_by_the_broker_do_not_block_commits():
    t = OffsetTracker()
    t.take("p", 0)
    t.take("p", 3)  # 1 and 2 never delivered (control records / compaction)
    t.done("p", 3)
    t.done("p", 0)
    assert t.committable() == {"p": 4}


def test_redelivery_below_the_commit_point_is_ignored():
    t = OffsetTracker()
    t.take("p", 0)
    t.done("p", 0)
    t.committed(t.committable())
    t.take("p", 0)
    assert t.in_flight() == 0 and t.committable() == {}


@given(st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_random_completion_orders_commit_exactly_the_done_prefix(n, seed):
    rng = random.Random(seed)
    t = OffsetTracker()
    for o in range(n):
        t.take("p", o)
    order = list(range(n))
    rng.shuffle(order)
    done: set[int] = set()
    committed = 0
    for o in order:
        t.done("p", o)
        done.add(o)
        c = t.committable()
        prefix = 0
        while prefix in done:
            prefix += 1
        if prefix > committed:
            assert c == {"p": prefix}
            t.committed(c)
            committed = prefix
        else:
            assert c == {}
    assert committed == n


def test_backpressure_on_stale_weights():
    bp = Backpressure(max_policy_lag=1)
    assert bp.open(engine_version=0)  # nothing published yet
    bp.published(1)
    assert bp.open(0)
    bp.published(2)
    assert not bp.open(0) and "lag" in bp.reason(0)
    assert bp.open(1)  # the receiver loaded version 1
    bp.published(1)  # an older announcement never lowers latest
    assert bp.latest == 2


def test_backpressure_quota_per_version():
    bp = Backpressure(max_policy_lag=1, groups_per_version=2)
    bp.took(10)
    assert bp.open(0)  # no trainer yet: not throttled
    bp.published(0)
    bp.took(3)
    assert bp.open(0)
    bp.took()
    assert not bp.open(0) and "since version 0" in bp.reason(0)
    bp.published(1)  # the trainer caught up
    assert bp.open(1) and bp.taken_since_latest == 0
