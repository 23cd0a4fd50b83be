"""Topic administration and whole-topic reads.

``ensure_topics`` creates every topic of a run with its configured partition count and retention
(``topics.retention_ms``, ``topics.retention_bytes``; we never rely on broker auto-creation); an existing topic is
left as it is. ``topic_configs`` reads a topic's configs back (DescribeConfigs). ``read_topic`` reads a topic from the beginning up to the
high-water mark of each partition (``highwater()``, not ``end_offsets()``, which Tansu gets wrong).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from topics.config import KafkaConfig, TopicsConfig
from topics.errors import BrokerError
from topics.kafka import Consumer, Received, client_kwargs, start_with_retries
from topics.names import Names


async def _admin(cfg: KafkaConfig) -> AIOKafkaAdminClient:
    admin = AIOKafkaAdminClient(**client_kwargs(cfg, client_id=f"{cfg.client_id}-admin"))
    await start_with_retries(admin, cfg, "admin", stop=admin.close)
    return admin


async def ensure_topics(cfg: KafkaConfig, names: Names, topics_cfg: TopicsConfig) -> list[str]:
    """Create the run's topics that do not exist yet; return the names created."""
    admin = await _admin(cfg)
    try:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(name=t, num_partitions=topics_cfg.partitions(t.split(".", 1)[1]),
                     replication_factor=topics_cfg.replication_factor,
                     topic_configs=topics_cfg.topic_configs(t.split(".", 1)[1]))
            for t in names.topics() if t not in existing
        ]
        created = []
        for topic in wanted:  # one at a time: a concurrent creator makes only that one fail
            try:
                await admin.create_topics([topic])
                created.append(topic.name)
            except TopicAlreadyExistsError:
                pass
        return created
    finally:
        await admin.close()


async def create_topic(cfg: KafkaConfig, topic: str, partitions: int, configs: dict[str, str]) -> bool:
    """Create one topic (replication factor 1: the embedded broker) unless it exists; True if created."""
    admin = await _admin(cfg)
    try:
        await admin.create_topics([NewTopic(name=topic, num_partitions=partitions, replication_factor=1,
                                            topic_configs=configs)])
        return True
    except TopicAlreadyExistsError:
        return False
    finally:
        await admin.close()


async def topic_configs(cfg: KafkaConfig, topic: str) -> dict[str, str]:
    """The configs the broker holds for ``topic`` (``{"retention.ms": "-1", ...}``)."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = await _admin(cfg)
    try:
        replies = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        await admin.close()
    out: dict[str, str] = {}
    for reply in replies:
        for resource in reply.resources:
            if resource[0]:  # error_code
                raise BrokerError(f"describe configs of {topic}: error {resource[0]} {resource[1]}")
            out.update({entry[0]: entry[1] for entry in resource[4]})
    return out


async def describe_topics(cfg: KafkaConfig, topics: list[str]) -> dict[str, dict[str, Any]]:
    """Partition count and high-water marks per topic."""
    admin = await _admin(cfg)
    try:
        meta = await admin.describe_topics(topics)
    finally:
        await admin.close()
    out: dict[str, dict[str, Any]] = {}
    for t in meta:
        if t.get("error_code", 0):
            out[t["topic"]] = {"error_code": t["error_code"], "partitions": 0}
            continue
        out[t["topic"]] = {"partitions": len(t["partitions"])}
    return out


async def partitions_of(consumer: Consumer, topic: str, timeout_s: float = 10.0) -> list[TopicPartition]:
    deadline = time.monotonic() + timeout_s
    while True:
        await consumer.raw.topics()  # refreshes metadata
        parts = consumer.raw.partitions_for_topic(topic)
        if parts:
            return [TopicPartition(topic, p) for p in sorted(parts)]
        if time.monotonic() > deadline:
            raise BrokerError(f"topic {topic} does not exist")
        await asyncio.sleep(0.2)


async def reader_from_start(cfg: KafkaConfig, topic: str, *, client_id: str,
                            expect: type | None = None) -> tuple[Consumer, list[TopicPartition]]:
    """A started, group-less consumer assigned every partition of ``topic`` at offset 0 (the caller stops it)."""
    consumer = Consumer(cfg, [], group_id=None, expect=expect, client_id=client_id)
    await consumer.start()
    try:
        tps = await partitions_of(consumer, topic)
    except BaseException:
        with contextlib.suppress(Exception):
            await consumer.stop()
        raise
    consumer.raw.assign(tps)
    for tp in tps:
        consumer.seek(tp, 0)
    return consumer, tps


async def read_topic(cfg: KafkaConfig, topic: str, *, expect: type | None = None,
                     idle_timeout_s: float = 5.0, max_wait_s: float = 120.0) -> list[Received]:
    """Every record of ``topic`` from offset 0 to the current high-water marks, decoded, in partition order."""
    consumer, tps = await reader_from_start(cfg, topic, expect=expect, client_id=f"{cfg.client_id}-reader")
    try:
        out: list[Received] = []
        deadline = time.monotonic() + max_wait_s
        idle_since = time.monotonic()
        while time.monotonic() < deadline:
            records = await consumer.getmany(timeout_ms=300)
            out.extend(records)
            if records:
                idle_since = time.monotonic()
            done = True
            for tp in tps:
                hw = consumer.highwater(tp)
                if hw is None or await consumer.position(tp) < hw:
                    done = False
            if done or time.monotonic() - idle_since > idle_timeout_s:
                break
        out.sort(key=lambda r: (r.partition, r.offset))
        return out
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()


async def highwaters(cfg: KafkaConfig, topic: str, *, timeout_s: float = 5.0) -> dict[int, int]:
    """The high-water mark of every partition of ``topic`` (learned from a fetch; Tansu's end_offsets is wrong)."""
    consumer, tps = await reader_from_start(cfg, topic, client_id=f"{cfg.client_id}-hw")
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await consumer.raw.getmany(timeout_ms=200, max_records=1)
            if all(consumer.highwater(tp) is not None for tp in tps):
                break
        return {tp.partition: consumer.highwater(tp) or 0 for tp in tps}
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()


async def group_offsets(cfg: KafkaConfig, group_id: str, topic: str) -> dict[int, int]:
    """Committed offsets of a consumer group on ``topic``: ``{partition: next offset}`` (absent = none).

    Read with a consumer that names the group but never joins it (OffsetFetch), because Tansu's answer to the
    admin client's ListConsumerGroupOffsets does not parse in aiokafka.
    """
    consumer = Consumer(cfg, [], group_id=group_id, client_id=f"{cfg.client_id}-offsets")
    await consumer.start()
    try:
        out = {}
        for tp in await partitions_of(consumer, topic):
            committed = await consumer.committed(tp)
            if committed is not None and committed >= 0:
                out[tp.partition] = committed
        return out
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()


async def group_lag(cfg: KafkaConfig, group_id: str, topic: str, hw: dict[int, int] | None = None) -> int:
    """Records of ``topic`` that ``group_id`` has not committed yet, summed over its partitions. ``hw``: the
    partitions' high-water marks when the caller has read them already (else they are read here)."""
    if hw is None:
        hw = await highwaters(cfg, topic)
    committed = await group_offsets(cfg, group_id, topic)
    return sum(max(0, h - committed.get(p, 0)) for p, h in hw.items())
