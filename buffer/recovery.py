"""Crash and rebalance recovery: which episodes were already decided, read back from the buffer's own outputs.

Why: a buffer commits an episodes partition only up to its lowest held offset, so after a crash (or when a
partition moves to another buffer) the new owner replays records whose batch or drop was already published.
Before processing a newly assigned partition the buffer reads the recent ``batches`` and ``drops`` records and
marks their episode ids and group ids DECIDED; replayed records of those episodes are then skipped.

How far back: every decision about an episode at or after the committed offset ``c`` was published after that
episode's record was produced. So the outputs are scanned backwards from their high-water marks, doubling the
window, until the window starts at a record older than ``since_ms`` (the Kafka timestamp of the record at ``c``,
minus an allowance for clock skew between hosts) or at offset 0. Batches are decoded as plain msgpack and only
their ids are kept.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import msgpack

from topics.admin import partitions_of
from topics.config import KafkaConfig
from topics.kafka import Consumer, TopicPartition

log = logging.getLogger("streamforge.buffer.recovery")


@dataclass(slots=True)
class Decided:
    """Episode and group ids found in the outputs, and how many records were read."""

    batched_episodes: set[str] = field(default_factory=set)
    dropped_episodes: set[str] = field(default_factory=set)
    incomplete_groups: set[str] = field(default_factory=set)  # dropped whole by their timeout
    records_read: int = 0


async def highwater_of(consumer: Consumer, tp: TopicPartition, timeout_s: float = 10.0) -> int:
    """The high-water mark of an assigned ``tp`` (learnt from a fetch: Tansu's ``end_offsets`` is wrong)."""
    consumer.seek(tp, 0)
    deadline = time.monotonic() + timeout_s
    while True:
        await consumer.raw.getmany(tp, timeout_ms=200, max_records=1)
        hw = consumer.highwater(tp)
        if hw is not None:
            return hw
        if time.monotonic() > deadline:
            raise TimeoutError(f"no high-water mark for {tp.topic}[{tp.partition}] after {timeout_s} s")


async def highwaters(kafka_cfg: KafkaConfig, topic: str) -> dict[int, int]:
    """The high-water mark of every partition of ``topic``."""
    consumer = Consumer(kafka_cfg, [], group_id=None, client_id=f"{kafka_cfg.client_id}-buffer-recovery")
    await consumer.start()
    try:
        tps = await partitions_of(consumer, topic)
        consumer.raw.assign(tps)
        return {tp.partition: await highwater_of(consumer, tp) for tp in tps}
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()


async def first_timestamp(consumer: Consumer, tp: TopicPartition, offset: int, timeout_s: float = 10.0) -> int | None:
    """Kafka timestamp (ms) of the record at ``offset`` of ``tp`` (None if there is none yet)."""
    consumer.seek(tp, offset)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await consumer.raw.getmany(tp, timeout_ms=300, max_records=1)
        recs = got.get(tp, [])
        if recs:
            return int(recs[0].timestamp)
        hw = consumer.highwater(tp)
        if hw is not None and hw <= offset:
            return None
    return None


async def _scan_back(consumer: Consumer, tp: TopicPartition, since_ms: int, *, first_window: int,
                     timeout_s: float) -> list[bytes]:
    """Values of the records of ``tp`` from the first one older than ``since_ms`` (or offset 0) to the end."""
    hw = await highwater_of(consumer, tp)
    if not hw:
        return []
    window = first_window
    while True:
        start = max(0, hw - window)
        consumer.seek(tp, start)
        values: list[bytes] = []
        oldest_ts: int | None = None
        pos = start
        deadline = time.monotonic() + timeout_s
        while pos < hw:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {tp.topic}[{tp.partition}] {start}..{hw} took over {timeout_s} s")
            got = await consumer.raw.getmany(tp, timeout_ms=300)
            for rec in got.get(tp, []):
                if rec.offset >= hw:
                    break
                if oldest_ts is None:
                    oldest_ts = int(rec.timestamp)
                values.append(rec.value)
                pos = rec.offset + 1
        if start == 0 or (oldest_ts is not None and oldest_ts < since_ms):
            return values
        window *= 2


async def read_decided(kafka_cfg: KafkaConfig, *, batches_topic: str, drops_topic: str, since_ms: int,
                       first_window: int = 256, timeout_s: float = 60.0) -> Decided:
    """Every decision published to ``batches_topic`` and ``drops_topic`` since ``since_ms`` (and a bit more)."""
    out = Decided()
    consumer = Consumer(kafka_cfg, [], group_id=None, client_id=f"{kafka_cfg.client_id}-buffer-recovery")
    await consumer.start()
    try:
        # partitions first: once a partition is assigned, the client's metadata narrows to the assigned topics
        tps = {topic: await partitions_of(consumer, topic) for topic in (batches_topic, drops_topic)}
        for topic in (batches_topic, drops_topic):
            for tp in tps[topic]:
                consumer.raw.assign([tp])
                for value in await _scan_back(consumer, tp, since_ms, first_window=first_window,
                                              timeout_s=timeout_s):
                    out.records_read += 1
                    try:
                        obj = msgpack.unpackb(value, raw=False)
                        ids = [str(e) for e in obj.get("episode_ids", [])]
                    except Exception as exc:  # noqa: BLE001 - msgpack raises many types; the audit reports it
                        log.warning("recovery: undecodable record on %s: %s", topic, exc)
                        continue
                    if topic == batches_topic:
                        out.batched_episodes.update(ids)
                    elif obj.get("reason") != "duplicate":  # a duplicate's original has its own decision
                        out.dropped_episodes.update(ids)
                        if obj.get("reason") == "incomplete":
                            out.incomplete_groups.add(str(obj.get("group_id", "")))
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()
    return out


async def committed_since_ms(kafka_cfg: KafkaConfig, committed: dict[TopicPartition, int | None],
                             skew_s: float) -> int | None:
    """The oldest Kafka timestamp among the records at the ``committed`` offsets, minus ``skew_s``.

    None when none of those partitions has a record at (or after) its committed offset: nothing to recover.
    """
    consumer = Consumer(kafka_cfg, [], group_id=None, client_id=f"{kafka_cfg.client_id}-buffer-recovery")
    await consumer.start()
    try:
        oldest: int | None = None
        consumer.raw.assign(list(committed))
        for tp, offset in committed.items():
            ts = await first_timestamp(consumer, tp, offset or 0)
            if ts is not None and (oldest is None or ts < oldest):
                oldest = ts
        return None if oldest is None else oldest - int(skew_s * 1000)
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()
