"""Episodes through a real Kafka-protocol broker: headers and trace context, committed offsets, dead letters."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from topics.admin import highwaters, read_topic
from topics.kafka import Consumer, DeadLetters, Producer
from topics.schemas import DeadLetter, Episode

pytestmark = pytest.mark.timeout(120)


def episode(i: int, group: str = "g1") -> Episode:
    n = 3 + i % 4
    return Episode(
        episode_id=f"{group}/{i}", group_id=group, group_size=4, prompt_id=group,
        prompt_tokens=np.arange(6, dtype=np.int32), response_tokens=np.arange(n, dtype=np.int32),
        logprobs=np.full(n, -0.5, dtype=np.float32), token_versions=np.zeros(n, dtype=np.int32),
        reward=float(i % 2), generator_id="gen-0",
    )


async def consume_until(consumer: Consumer, n: int, timeout_s: float = 30.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += await consumer.getmany(timeout_ms=300)
    return got


async def test_episodes_round_trip_with_headers_and_trace_context(run_config) -> None:
    cfg, names = run_config.kafka, run_config.names
    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    async with Producer(cfg) as producer:
        with tracer.start_as_current_span("produce") as span:
            for i in range(8):
                await producer.send(names.episodes, episode(i, group=f"g{i % 2}"), key=f"g{i % 2}",
                                    headers=[("x-run", b"test"), ("x-empty", b"")])
            sent_trace = span.get_span_context().trace_id
    records = await read_topic(cfg, names.episodes, expect=Episode)
    assert len(records) == 8
    assert all(r.error is None for r in records)
    assert {r.value.episode_id for r in records} == {f"g{i % 2}/{i}" for i in range(8)}
    for r in records:  # same key -> same partition: a group is whole in one partition
        assert r.key == r.value.group_id
        assert r.headers["x-run"] == b"test" and r.headers["x-empty"] == b""
        assert trace.get_current_span(r.context).get_span_context().trace_id == sent_trace
    assert len({r.partition for r in records if r.key == "g0"}) == 1
    assert np.array_equal(records[0].value.prompt_tokens, np.arange(6))


async def test_committed_offsets_resume_a_consumer_group(run_config) -> None:
    cfg, names = run_config.kafka, run_config.names
    group = f"{names.prefix}.resume"
    async with Producer(cfg) as producer:
        for i in range(10):
            await producer.send(names.episodes, episode(i, group=f"k{i}"), key=f"k{i}")
    async with Consumer(cfg, [names.episodes], group_id=group, expect=Episode) as consumer:
        got = await consume_until(consumer, 10)
        assert len(got) == 10
        first_half = sorted(got, key=lambda r: (r.partition, r.offset))
        # commit only the first record of each partition
        offsets = {}
        for r in first_half:
            offsets.setdefault(r.tp, r.offset + 1)
        await consumer.commit(offsets)
    async with Consumer(cfg, [names.episodes], group_id=group, expect=Episode) as consumer:
        again = await consume_until(consumer, 10 - len(offsets), timeout_s=30)
        assert {r.value.episode_id for r in again} == {r.value.episode_id for r in got} - {
            r.value.episode_id for r in first_half if r.offset + 1 == offsets[r.tp]}
        assert await consume_until(consumer, 1, timeout_s=1.5) == []


async def test_malformed_records_go_to_dead_letter_with_reason(run_config) -> None:
    cfg, names = run_config.kafka, run_config.names
    async with Producer(cfg) as producer:
        await producer.send_raw(names.episodes, b"\x93not an episode", key="bad")
        await producer.send(names.episodes, episode(1), key="g1")
        dead = DeadLetters(producer, names, role="test")
        records = await read_topic(cfg, names.episodes, expect=Episode)
        assert [r.error is not None for r in records].count(True) == 1
        for r in records:
            if r.error is not None:
                await dead.send(r)
    letters = await read_topic(cfg, names.dead_letter, expect=DeadLetter)
    assert len(letters) == 1
    letter = letters[0].value
    assert letter.source == names.episodes and letter.reason == "malformed"
    assert letter.value == b"\x93not an episode" and letter.role == "test" and letter.offset >= 0


async def test_large_messages_pass(run_config) -> None:
    cfg, names = run_config.kafka, run_config.names
    n = 1_200_000  # 14.4 MB: close to the 16 MiB default limit
    big = Episode(episode_id="big/0", group_id="big", group_size=1, prompt_id="big",
                  prompt_tokens=np.zeros(1, np.int32), response_tokens=np.zeros(n, np.int32),
                  logprobs=np.zeros(n, np.float32), token_versions=np.zeros(n, np.int32))
    async with Producer(cfg) as producer:
        await producer.send(names.episodes, big, key="big")
    records = await read_topic(cfg, names.episodes, expect=Episode)
    assert records[0].value.response_tokens.shape == (n,)


async def test_highwater_reports_record_counts(run_config) -> None:
    cfg, names = run_config.kafka, run_config.names
    async with Producer(cfg) as producer:
        for i in range(5):
            await producer.send(names.episodes, episode(i, group="same"), key="same")
    marks = await highwaters(cfg, names.episodes)
    assert sum(marks.values()) == 5 and max(marks.values()) == 5


async def test_concurrent_producers_and_consumers_lose_nothing(run_config) -> None:
    cfg, names = run_config.kafka, run_config.names

    async def produce(k: int) -> None:
        async with Producer(cfg, client_id=f"p{k}") as producer:
            futs = [await producer.enqueue(names.episodes, episode(i, group=f"c{k}-{i}"), key=f"c{k}-{i}")
                    for i in range(50)]
            await asyncio.gather(*futs)

    await asyncio.gather(*(produce(k) for k in range(3)))
    records = await read_topic(cfg, names.episodes, expect=Episode)
    assert len({r.value.episode_id for r in records}) == 150
