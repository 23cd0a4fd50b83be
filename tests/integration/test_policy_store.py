"""PolicyVersion in NATS JetStream KV: put/get/watch, compare-and-set, and the notification subject."""

from __future__ import annotations

import asyncio

import pytest

from topics.errors import StaleWriter
from topics.nats import PolicyStore, connect, decode_msg, msg_context
from topics.schemas import PolicyVersion

pytestmark = pytest.mark.timeout(60)


async def test_publish_latest_watch_and_compare_and_set(run_config) -> None:
    nc = await connect(run_config.nats, name="test")
    try:
        store = PolicyStore(nc, run_config.names)
        await store.start()
        await store.start()  # idempotent
        assert await store.latest() == (None, 0)
        notified: list[int] = []

        async def on_msg(msg) -> None:
            notified.append(decode_msg(msg, expect=PolicyVersion).version)
            assert msg_context(msg) is not None

        await nc.subscribe(run_config.names.policy_subject, cb=on_msg)
        seen: list[int] = []

        async def watch() -> None:
            async for pv in store.watch():
                seen.append(pv.version)

        rev1 = await store.publish(PolicyVersion(version=1, step=1, batch_ids=["b1"]), expected_revision=0)
        watcher = asyncio.create_task(watch())  # a watch starts with the current version...
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.05)
        assert seen == [1]
        rev2 = await store.publish(PolicyVersion(version=2, step=2, transport="file", path="/w/2"),
                                   expected_revision=rev1)  # ...then sees every newer one
        with pytest.raises(StaleWriter):  # a zombie writer that still believes rev1 is latest
            await store.publish(PolicyVersion(version=99, step=99), expected_revision=rev1)
        with pytest.raises(StaleWriter):  # a second "first" writer
            await store.publish(PolicyVersion(version=1, step=1), expected_revision=0)
        for _ in range(100):
            if seen == [1, 2] and notified == [1, 2]:
                break
            await asyncio.sleep(0.05)
        assert seen == [1, 2] and notified == [1, 2]
        latest, rev = await store.latest()
        assert latest.version == 2 and latest.path == "/w/2" and rev == rev2
        # a late joiner's watch starts with the current version
        late: list[int] = []

        async def watch_late() -> None:
            async for pv in store.watch():
                late.append(pv.version)

        late_task = asyncio.create_task(watch_late())
        for _ in range(50):
            if late:
                break
            await asyncio.sleep(0.05)
        assert late == [2]
        watcher.cancel()
        late_task.cancel()
        await asyncio.gather(watcher, late_task, return_exceptions=True)
    finally:
        await nc.close()


async def test_unreachable_nats_fails_with_the_address(run_config) -> None:
    from streamforge.brokers import free_port
    from topics.config import NatsConfig
    from topics.errors import BrokerUnavailable

    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(BrokerUnavailable) as err:
        await connect(NatsConfig(url=url, connect_retries=2, connect_timeout_s=0.5), name="t")
    assert url in str(err.value) and err.value.retriable


async def test_status_shows_versions_per_generator_and_fencing(run_config) -> None:
    from streamforge.status import nats_status
    from topics.nats import publish_msg
    from topics.schemas import Membership, VersionAck

    nc = await connect(run_config.nats, name="fake-generators")
    try:
        store = PolicyStore(nc, run_config.names)
        await store.start()
        await store.publish(PolicyVersion(version=7, step=7), expected_revision=0)
        await store.put("fenced", b'{"gen-b": {"last_acked_version": 5, "fenced_at": 1.0, "missed_version": 6}}')

        async def chatter() -> None:
            while True:
                await publish_msg(nc, run_config.names.membership_subject,
                                  Membership(generator_id="gen-b", event="heartbeat", version=5))
                await publish_msg(nc, run_config.names.ack_subject, VersionAck(generator_id="gen-a", version=7))
                await asyncio.sleep(0.1)

        task = asyncio.create_task(chatter())
        try:
            status = await nats_status(run_config, listen_s=1.0)
        finally:
            task.cancel()
        assert status["latest_version"] == 7
        assert status["generators"]["gen-a"]["version"] == 7 and status["generators"]["gen-b"]["version"] == 5
        assert status["fenced"]["gen-b"]["last_acked_version"] == 5
    finally:
        await nc.close()
