"""Regression pins for what the embedded broker (Tansu 0.6) lacks, so a broker upgrade shows up here.

Design consequences (see README): at-least-once delivery with deduplication (no idempotent producer, no
transactions), explicit topic creation, and ``highwater()`` instead of ``end_offsets()``/``seek_to_end()``.
Skipped against a broker other than Tansu (an external Apache Kafka), where ``tests/integration/test_external_kafka.py``
exercises these features; they run against an external Tansu (a separate ``streamforge brokers``) too.
"""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from topics.admin import highwaters

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


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
