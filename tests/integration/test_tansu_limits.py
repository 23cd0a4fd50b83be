"""Regression pins for what the embedded broker (Tansu 0.6) lacks, so a broker upgrade shows up here.

Design consequences (see README): at-least-once delivery with deduplication (no idempotent producer, no
transactions), explicit topic creation, ``highwater()`` instead of ``end_offsets()``/``seek_to_end()``, and
retention that only a real Kafka enforces (Tansu stores it; no DeleteRecords).
Skipped against a broker other than Tansu (an external Apache Kafka), where ``tests/integration/test_external_kafka.py``
exercises these features; they run against an external Tansu (a separate ``streamforge brokers``) too.
"""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from topics.admin import highwaters

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def embedded_only(brokers):
    if not brokers.tansu:
        pytest.skip("pins the embedded Tansu broker's limits; this Kafka broker is not Tansu")
    return brokers


async def test_idempotent_producer_is_not_supported(embedded_only, run_config) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=embedded_only.kafka_bootstrap, enable_idempotence=True)
    with pytest.raises(Exception) as err:
        await producer.start()
    await producer.stop()
    assert "UnknownError" in type(err.value).__name__ or "Unknown" in str(err.value)


async def test_end_offsets_is_wrong_but_highwater_is_right(embedded_only, run_config) -> None:
    topic = run_config.names.batches  # one partition
    producer = AIOKafkaProducer(bootstrap_servers=embedded_only.kafka_bootstrap, linger_ms=50)
    await producer.start()
    try:
        futs = [await producer.send(topic, b"x" * 10, partition=0) for _ in range(10)]
        for f in futs:
            await f
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=embedded_only.kafka_bootstrap)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        end = (await consumer.end_offsets([tp]))[tp]
    finally:
        await consumer.stop()
    assert (await highwaters(run_config.kafka, topic))[0] == 10
    assert end != 10, "Tansu now reports end_offsets correctly: seek_to_end/latest may be usable again"



async def test_retention_is_stored_not_enforced_and_delete_records_is_missing(embedded_only) -> None:
    """A replay finds a batch gone only by its absence (``streamforge/replay.py``): Tansu keeps a topic's
    ``retention.ms`` without deleting anything, and drops the connection at DeleteRecords."""
    import asyncio
    import uuid

    from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete

    from topics.admin import topic_configs
    from topics.config import KafkaConfig

    topic = f"limits-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=embedded_only.kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"retention.ms": "100"})])
        producer = AIOKafkaProducer(bootstrap_servers=embedded_only.kafka_bootstrap)
        await producer.start()
        try:
            for _ in range(5):
                await producer.send_and_wait(topic, b"x", partition=0)
        finally:
            await producer.stop()
        await asyncio.sleep(1.5)
        cfg = KafkaConfig(bootstrap=embedded_only.kafka_bootstrap)
        assert (await topic_configs(cfg, topic))["retention.ms"] == "100"
        assert (await highwaters(cfg, topic))[0] == 5
        with pytest.raises(Exception) as err:
            await admin.delete_records({TopicPartition(topic, 0): RecordsToDelete(3)}, timeout_ms=5000)
        assert "Connection" in type(err.value).__name__ or "closed" in str(err.value), err.value
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(bootstrap_servers=embedded_only.kafka_bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        got = await consumer.getmany(timeout_ms=3000)
        assert sum(len(v) for v in got.values()) == 5, "Tansu now enforces retention or DeleteRecords"
    finally:
        await consumer.stop()


# -- a librdkafka client: confluent-kafka (librdkafka 2.16) --------------------------------------------------
# Debian's kcat 1.7.1 (librdkafka 2.0.2) cannot parse Tansu's ApiVersions reply ("Protocol read buffer underflow
# for ApiVersion v3"); a current librdkafka can. Tansu holds a group join for about half the session timeout,
# so librdkafka's default (45 s) makes a consumer's first message wait about 22 s; at 6000 ms, as
# streamforge's own clients use, it arrives in about 3 s.


def _confluent_roundtrip(bootstrap: str, topic: str, *, session_timeout_ms: int | None, wait_s: float) -> tuple:
    """Create ``topic``, produce 10 records, then read them in a consumer group for at most ``wait_s``; returns
    (delivered, received, seconds to the first record or None)."""
    import time

    confluent_kafka = pytest.importorskip("confluent_kafka")
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert admin.list_topics(timeout=10).brokers  # metadata
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[topic].result(10)
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    delivered = []
    for i in range(10):
        producer.produce(topic, value=f"v{i}".encode(), key=f"k{i}".encode(),
                         on_delivery=lambda err, msg: delivered.append(err is None))
    producer.flush(10)
    conf = {"bootstrap.servers": bootstrap, "group.id": f"{topic}-group", "auto.offset.reset": "earliest"}
    if session_timeout_ms is not None:
        conf["session.timeout.ms"] = session_timeout_ms
    consumer = confluent_kafka.Consumer(conf)
    consumer.subscribe([topic])
    received, first, t0 = 0, None, time.monotonic()
    try:
        while received < 10 and time.monotonic() - t0 < wait_s:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                received += 1
                first = first if first is not None else time.monotonic() - t0
    finally:
        consumer.close()
    return sum(delivered), received, first


def test_confluent_kafka_works_with_a_short_session_timeout(embedded_only, run_config) -> None:
    delivered, received, first = _confluent_roundtrip(embedded_only.kafka_bootstrap, f"{run_config.run.prefix}.ck",
                                                      session_timeout_ms=6000, wait_s=20)
    assert delivered == 10 and received == 10, (delivered, received)
    assert first is not None and first < 10


def test_confluent_kafka_at_its_default_session_timeout_waits_on_the_join(embedded_only, run_config) -> None:
    delivered, received, _ = _confluent_roundtrip(embedded_only.kafka_bootstrap, f"{run_config.run.prefix}.ck45",
                                                  session_timeout_ms=None, wait_s=8)
    assert delivered == 10
    assert received == 0, "Tansu no longer holds a join for half of librdkafka's 45 s session timeout"
