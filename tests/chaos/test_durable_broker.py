"""Durable mode (Tansu over a local SeaweedFS): SIGKILL the Kafka broker mid-stream and restart it; nothing that was
acknowledged is lost, committed offsets survive, and producers/consumers carry on after the restart."""

from __future__ import annotations

import time

import numpy as np
import pytest

from streamforge.brokers import EmbeddedBrokers
from topics.admin import ensure_topics, read_topic
from topics.config import KafkaConfig, TopicsConfig
from topics.kafka import Consumer, Producer
from topics.names import Names
from topics.schemas import Episode

pytestmark = pytest.mark.timeout(300)


def episode(i: int) -> Episode:
    return Episode(episode_id=f"g{i}/0", group_id=f"g{i}", group_size=1, prompt_id=f"g{i}",
                   prompt_tokens=np.arange(4, dtype=np.int32), response_tokens=np.arange(3, dtype=np.int32),
                   logprobs=np.zeros(3, np.float32), token_versions=np.zeros(3, np.int32))


async def consume(consumer: Consumer, n: int, timeout_s: float = 60) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += await consumer.getmany(timeout_ms=500)
    return got


async def test_broker_sigkill_and_restart_loses_nothing(tmp_path) -> None:
    brokers = EmbeddedBrokers(tmp_path / "brokers", durable=True)
    await brokers.start()
    try:
        cfg = KafkaConfig(bootstrap=brokers.kafka_bootstrap, connect_retries=20)
        names = Names("durable")
        await ensure_topics(cfg, names, TopicsConfig(episodes_partitions=2))
        async with Producer(cfg) as producer:
            for i in range(40):
                await producer.send(names.episodes, episode(i), key=f"g{i}")
        async with Consumer(cfg, [names.episodes], group_id="durable.buffers", expect=Episode) as consumer:
            got = await consume(consumer, 40)
            assert len(got) == 40
            first = sorted(got, key=lambda r: (r.partition, r.offset))
            offsets = {}
            for r in first:  # commit the first 10 of each partition
                if r.offset < 10:
                    offsets[r.tp] = r.offset + 1
            await consumer.commit(offsets)

        brokers.stop_one("tansu", kill=True)  # SIGKILL mid-stream
        await brokers.start_kafka()  # same port, same S3 bucket

        records = await read_topic(cfg, names.episodes, expect=Episode)
        assert sorted(r.value.episode_id for r in records) == sorted(f"g{i}/0" for i in range(40))
        async with Producer(cfg) as producer:  # producing goes on after the restart
            for i in range(40, 50):
                await producer.send(names.episodes, episode(i), key=f"g{i}")
        async with Consumer(cfg, [names.episodes], group_id="durable.buffers", expect=Episode) as consumer:
            resumed = await consume(consumer, 50 - sum(offsets.values()))
        assert len({r.value.episode_id for r in resumed}) == 50 - sum(offsets.values())
        assert all(r.offset >= offsets.get(r.tp, 0) for r in resumed)
    finally:
        brokers.stop()
