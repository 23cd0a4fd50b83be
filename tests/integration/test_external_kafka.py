"""What the embedded Tansu broker lacks, exercised where the broker has it (a real Apache Kafka cluster named by
``STREAMFORGE_KAFKA_BOOTSTRAP``): the idempotent producer (``kafka.idempotent``), ``end_offsets()`` /
``seek_to_end()`` agreeing with the high-water marks, and ``auto_offset_reset="latest"``.

On Tansu, embedded or external (a separate ``streamforge brokers``), only the first test runs (the clear start-up
error for ``kafka.idempotent``); the rest skip, and ``test_tansu_limits.py`` pins what Tansu gets wrong instead.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from topics.admin import highwaters
from topics.errors import ConfigError
from topics.kafka import Consumer, Producer
from topics.schemas import Prompt

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def external_only(brokers):
    if brokers.tansu:
        pytest.skip("needs an Apache Kafka (STREAMFORGE_KAFKA_BOOTSTRAP); Tansu has no idempotence or seek_to_end")
    return brokers


def prompts(n: int, tag: str) -> list[Prompt]:
    return [Prompt(prompt_id=f"{tag}-{i}", text=f"{i}+1=", task="addmod10") for i in range(n)]


async def test_idempotent_producer_on_tansu_is_a_clear_config_error(brokers, run_config) -> None:
    if not brokers.tansu:
        pytest.skip("this Kafka broker is not Tansu: it has idempotence")
    cfg = dataclasses.replace(run_config.kafka, idempotent=True, connect_retries=1)
    with pytest.raises(ConfigError) as err:
        async with Producer(cfg):
            pass
    assert err.value.key == "kafka.idempotent" and "Tansu" in str(err.value)


async def test_idempotent_producer_delivers_each_record_once(external_only, run_config) -> None:
    cfg = dataclasses.replace(run_config.kafka, idempotent=True)
    topic = run_config.names.prompts
    sent = prompts(200, "idem")
    async with Producer(cfg) as producer:
        futs = [await producer.enqueue(topic, p, key=p.prompt_id) for p in sent]
        await asyncio.gather(*futs)
    got = []
    async with Consumer(run_config.kafka, [topic], group_id=f"{run_config.names.prefix}.idem") as consumer:
        while len(got) < len(sent):
            got += [r.value.prompt_id for r in await consumer.getmany(timeout_ms=2000)]
    assert sorted(got) == sorted(p.prompt_id for p in sent)


async def test_end_offsets_and_seek_to_end_agree_with_highwater(external_only, run_config) -> None:
    topic = run_config.names.batches  # one partition
    async with Producer(run_config.kafka) as producer:
        for p in prompts(10, "end"):
            await producer.send(topic, p, key=p.prompt_id, partition=0)
    hw = (await highwaters(run_config.kafka, topic))[0]
    consumer = AIOKafkaConsumer(bootstrap_servers=run_config.kafka.bootstrap)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        assert (await consumer.end_offsets([tp]))[tp] == hw == 10
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        assert await consumer.position(tp) == hw
    finally:
        await consumer.stop()


async def test_auto_offset_reset_latest_reads_only_new_records(external_only, run_config) -> None:
    topic = run_config.names.episodes
    async with Producer(run_config.kafka) as producer:
        for p in prompts(5, "old"):
            await producer.send(topic, p, key=p.prompt_id)
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=run_config.kafka.bootstrap, auto_offset_reset="latest",
                                group_id=f"{run_config.names.prefix}.latest", enable_auto_commit=False)
    await consumer.start()
    try:
        while not consumer.assignment():
            await asyncio.sleep(0.2)
        for tp in consumer.assignment():
            await consumer.position(tp)  # resolves "latest" before the new records are written
        async with Producer(run_config.kafka) as producer:
            for p in prompts(3, "new"):
                await producer.send(topic, p, key=p.prompt_id)
        got = []
        while len(got) < 3:
            batch = await consumer.getmany(timeout_ms=2000)
            got += [m.key for msgs in batch.values() for m in msgs]
        assert sorted(got) == [f"new-{i}".encode() for i in range(3)]
    finally:
        await consumer.stop()
