"""The run's log archive (``streamforge/logarchive.py``) on real brokers: every record copied as it is written,
then restored into a fresh embedded broker at the same offsets, with keys, headers, timestamps, topic configs and
the consumer groups' committed offsets; archiving continues after a restore without copying anything twice."""

from __future__ import annotations

import numpy as np
import pytest

from streamforge.brokers import EmbeddedBrokers
from streamforge.config import load_config
from streamforge.logarchive import Archiver, iter_partition, log_dir, restore, start_archive
from topics.admin import group_offsets, read_topic, topic_configs
from topics.kafka import Consumer, Producer
from topics.schemas import DropRecord, Episode

pytestmark = pytest.mark.timeout(180)


def episode(i: int) -> Episode:
    return Episode(episode_id=f"g{i}/0", group_id=f"g{i}", group_size=1, prompt_id=f"p{i}",
                   prompt_tokens=np.arange(3, dtype=np.int32), response_tokens=np.arange(2, dtype=np.int32),
                   logprobs=np.zeros(2, np.float32), token_versions=np.zeros(2, np.int32))


async def test_a_run_log_archived_then_restored_into_a_fresh_broker(tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = EmbeddedBrokers(tmp_path / "b1")
    await first.start()
    try:
        config = load_config(None, [f"--run.run_dir={run_dir}", f"--kafka.bootstrap={first.kafka_bootstrap}",
                                    "--run.prefix=arch", "--topics.episodes_partitions=2",
                                    "--topics.retention_ms.batches=-1"], environ={})
        archiver = await start_archive(config.kafka, config.names, config.topics, run_dir)
        async with Producer(config.kafka) as producer:
            for i in range(30):
                await producer.send(config.names.episodes, episode(i), key=f"g{i}")
            await producer.send(config.names.drops, DropRecord(episode_ids=["g0/0"], reason="stale"), key="g0")
        async with Consumer(config.kafka, [config.names.episodes], group_id=config.names.buffers_group,
                            expect=Episode) as consumer:  # the buffers' group commits part of the episodes
            got = []
            while len(got) < 30:
                got += await consumer.getmany(timeout_ms=500)
            await consumer.commit({r.tp: r.offset + 1 for r in got if r.offset < 5})
        before = await read_topic(config.kafka, config.names.episodes, expect=Episode)
        committed = await group_offsets(config.kafka, config.names.buffers_group, config.names.episodes)
        await archiver.close()
        assert archiver.records == 31
    finally:
        first.stop()
    files = sorted(p.relative_to(log_dir(run_dir)).as_posix() for p in log_dir(run_dir).rglob("*.msgpack"))
    assert files == ["arch.drops/0.msgpack", "arch.episodes/0.msgpack", "arch.episodes/1.msgpack"]
    assert sum(1 for _ in iter_partition(log_dir(run_dir) / "arch.episodes" / "0.msgpack")) > 0

    second = EmbeddedBrokers(tmp_path / "b2")  # a fresh, empty broker
    await second.start()
    try:
        config.kafka.bootstrap = second.kafka_bootstrap
        assert await restore(config.kafka, run_dir) == 31
        after = await read_topic(config.kafka, config.names.episodes, expect=Episode)
        assert [(r.partition, r.offset, r.key, r.value.episode_id, r.timestamp_ms) for r in after] == \
            [(r.partition, r.offset, r.key, r.value.episode_id, r.timestamp_ms) for r in before]
        assert all(a.headers == b.headers for a, b in zip(after, before))  # trace context kept
        assert await group_offsets(config.kafka, config.names.buffers_group, config.names.episodes) == committed
        assert (await topic_configs(config.kafka, config.names.batches))["retention.ms"] == "-1"
        again = Archiver(config.kafka, config.names, config.topics, run_dir)  # continues after what it holds
        await again.start()
        async with Producer(config.kafka) as producer:
            await producer.send(config.names.episodes, episode(99), key="g99", partition=0)
        await again.close()
        assert again.records == 1
        offsets = [r["o"] for r in iter_partition(log_dir(run_dir) / "arch.episodes" / "0.msgpack")]
        assert offsets == list(range(len(offsets)))
    finally:
        second.stop()
