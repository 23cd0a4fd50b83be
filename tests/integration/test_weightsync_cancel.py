"""A generator's weight follower ends when its owner cancels it once, whatever it was awaiting at that moment.

Real NATS and the real ``Engine`` class, not started: a follower with no trainer to join only reads the engine's
version. With a heartbeat every millisecond the follower spends its time sending NATS messages under a deadline;
it is cancelled at 60 different points of that, and each time its loop must end within 2 s. Under Python 3.11's
``asyncio.wait_for`` a cancel that arrived in the loop turn in which the message went out was dropped
(``topics/deadlines.py``): the follower beat on, and its owner (a test's clean-up, a role's stop) waited for it
without end; 8 of the 60 rounds did. nats-py's own ``wait_for`` can still drop one, which the follower's loop
answers by cancelling again (``cancel_and_wait``).
"""

from __future__ import annotations

import asyncio

import pytest

from topics import codec
from topics.nats import connect
from topics.schemas import Membership
from weightsync.config import WeightSyncConfig
from weightsync.receiver import WeightReceiver

pytestmark = [pytest.mark.timeout(120)]


async def test_a_cancelled_follower_always_ends(run_config, tmp_path):
    from producers.engine import Engine

    cfg = WeightSyncConfig(transport="gloo", heartbeat_s=0.001, join_timeout_s=0.5, timeout_s=5)
    engine = Engine(str(tmp_path / "unused"))  # never started: the follower reads only its version
    nc = await connect(run_config.nats, name="generator")
    beats: list[str] = []

    async def on_membership(msg) -> None:
        if (m := codec.decode(msg.data, expect=Membership)).event == "heartbeat":
            beats.append(m.generator_id)

    sub = await nc.subscribe(run_config.names.membership_subject, cb=on_membership)
    stuck: list[int] = []
    try:
        for turns in range(60):
            receiver = WeightReceiver(cfg, engine=engine, nc=nc, names=run_config.names, generator_id=f"g{turns}")
            await receiver.start()
            follow = asyncio.create_task(receiver.loop())
            await asyncio.sleep(0.02)  # past the join request (no trainer answers it): beating and watching now
            for _ in range(turns % 12):
                await asyncio.sleep(0)  # a different point of a beat each time
            follow.cancel()
            done, _ = await asyncio.wait([follow], timeout=2.0)
            if not done:  # end its loops for the next round: a cancel of the loop no longer reaches them
                stuck.append(turns)
                for _ in range(100):  # each cancel can be dropped the same way: again until one lands
                    for task in asyncio.all_tasks():
                        if task.get_name() in ("weightsync-heartbeat", "weightsync-follow"):
                            task.cancel()
                    if (await asyncio.wait([follow], timeout=0.05))[0]:
                        break
            assert follow.done(), f"round {turns}: the follower's loops outlived 100 cancels"
            await receiver.stop()
        await nc.flush()
        assert not stuck, f"the follower went on after its cancel in rounds {stuck}"
        assert len(set(beats)) == 60 and len(beats) > 300  # every follower was beating when it was cancelled
    finally:
        await sub.unsubscribe()
        await nc.close()
