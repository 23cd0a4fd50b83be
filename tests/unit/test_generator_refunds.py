"""Quota refunds from the buffer's drops (producers/refunds.py): which drops give a generator's quota back."""

from __future__ import annotations

import msgpack

from producers.flow import Backpressure
from producers.refunds import DropRefunds
from topics.codec import decode, encode
from topics.config import KafkaConfig
from topics.schemas import DropRecord


def refunds() -> tuple[DropRefunds, Backpressure]:
    bp = Backpressure(max_policy_lag=0, groups_per_step=4, window_steps=2)
    return DropRefunds(KafkaConfig(), "x.drops", refund=bp.refund, client_id="t"), bp


def test_a_group_of_ours_dropped_stale_on_arrival_gives_its_quota_back_once() -> None:
    r, bp = refunds()
    r.produced("g1")
    bp.took(8)
    assert not bp.open(0)  # 8 taken, quota 8 at step 0
    drop = DropRecord(episode_ids=["g1/0"], reason="stale", group_id="g1")
    assert r.on_drop(drop) and bp.taken == 7 and bp.open(0)
    assert not r.on_drop(drop) and bp.taken == 7  # a redelivered record: once
    assert not r.on_drop(DropRecord(episode_ids=["h/0"], reason="stale", group_id="h"))  # not ours
    r.produced("g2")
    assert not r.on_drop(DropRecord(episode_ids=["g2/0"], reason="duplicate", group_id="g2"))
    assert r.on_drop(DropRecord(episode_ids=["g2/0"], reason="incomplete", group_id="g2")) and bp.taken == 6


def test_a_stale_group_that_waited_for_the_trainer_is_surplus_not_refunded() -> None:
    r, bp = refunds()
    r.produced("g")
    bp.took(8)
    assert not r.on_drop(DropRecord(episode_ids=["g/0"], reason="stale", group_id="g", waited=True))
    assert bp.taken == 8 and bp.refunded == 0 and r.surplus == 1 and not bp.open(0)
    bp.progressed(1)  # the trainer's next step opens the quota again
    assert bp.open(0)


def test_waited_round_trips_and_older_records_read_as_not_waited() -> None:
    rec = DropRecord(episode_ids=["g/0"], reason="stale", group_id="g", waited=True)
    assert decode(encode(rec), expect=DropRecord).waited
    old = msgpack.unpackb(encode(DropRecord(episode_ids=["g/0"], reason="stale", group_id="g")), raw=False)
    old.pop("waited")  # as written before the field existed
    assert decode(msgpack.packb(old), expect=DropRecord).waited is False
