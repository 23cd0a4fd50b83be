"""A finished run reopened: its config from its directory, and its log on brokers that hold it.

``run_config(run_dir)`` loads ``<run_dir>/config.yaml`` (``up`` writes it; a run started role by role passes its
``--config`` instead) with ``run.run_dir`` set to ``run_dir``. ``reopen(config)`` then yields the config pointed at
brokers that hold the run's topics and its JetStream state, in this order:

* the brokers the config names (``kafka.bootstrap`` and ``nats.url``: external ones, or set by the caller);
* the embedded brokers another process serves from the run's broker directory (``brokers.data_dir``, by default
  ``<run_dir>/brokers``): its ``up`` still runs, or another replay reopened it (``streamforge.brokers.serving``);
* else the embedded brokers started again on that directory: over the S3 store ``up`` left there
  (``brokers.durable``), or in memory with the run's archive (``<run_dir>/log``, ``brokers.archive``, the default)
  restored into them (``streamforge/logarchive.py``); NATS on its JetStream store there either way. They are
  stopped when the context exits.

A run that kept neither cannot be reopened: ``RunLogUnavailable``.

Reading the log: ``scan`` streams a topic's retained records, ``locate`` finds where records are by id, and
``records_at`` reads records at known positions in a given order, forward per partition, keeping none but the
next ones (replay and provenance read a run of any length this way).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from topics.errors import StreamforgeError

log = logging.getLogger("streamforge.runlog")

CONFIG_FILE = "config.yaml"


class RunLogUnavailable(StreamforgeError):
    """The run's log cannot be read again (no durable store, no config, no ledger); not retriable."""

    def __init__(self, run_dir: Path | str, why: str) -> None:
        super().__init__(f"run {run_dir}: {why}")
        self.run_dir = Path(run_dir)
        self.why = why


def run_config(run_dir: str | Path, *, config_path: str | None = None, overrides: Sequence[str] = ()) -> Any:
    """The run's config: ``config_path`` if given, else ``<run_dir>/config.yaml``; ``run.run_dir`` is ``run_dir``,
    then ``overrides`` (``--section.key=value``) apply."""
    from streamforge.config import load_config

    run_dir = Path(run_dir)
    path = Path(config_path) if config_path else run_dir / CONFIG_FILE
    if not path.exists():
        raise RunLogUnavailable(run_dir, f"no {path.name} (a run started role by role: pass its --config)")
    return load_config(path, [f"--run.run_dir={run_dir}", *overrides])


def broker_dir(config: Any) -> Path:
    """Where ``up`` keeps the run's embedded brokers (their durable store, lock and endpoints)."""
    return Path(config.brokers.data_dir) if config.brokers.data_dir else config.run_dir / "brokers"


@contextlib.asynccontextmanager
async def reopen(config: Any) -> AsyncIterator[Any]:
    """Yield a copy of ``config`` whose ``kafka.bootstrap`` and ``nats.url`` reach the run's log (module
    docstring); embedded brokers started here stop on exit."""
    from streamforge.brokers import EmbeddedBrokers, serving

    config = dataclasses.replace(config, kafka=dataclasses.replace(config.kafka),
                                 nats=dataclasses.replace(config.nats))
    if config.kafka.bootstrap and config.nats.url:
        yield config
        return
    data_dir = broker_dir(config)
    live = serving(data_dir)
    if live is not None:
        log.info("the run's brokers are served by process %s: %s", live.get("pid"), live.get("kafka_bootstrap"))
        config.kafka.bootstrap = config.kafka.bootstrap or live["kafka_bootstrap"]
        config.nats.url = config.nats.url or live["nats_url"]
        yield config
        return
    from streamforge.logarchive import has_archive, restore

    durable = config.brokers.durable and (data_dir / "seaweedfs").is_dir()
    if not durable and not has_archive(config.run_dir):
        raise RunLogUnavailable(config.run_dir, "its log was not kept (no archive in log/, no durable store in "
                                f"{data_dir.name}/): it ran with brokers.archive false and brokers.durable false")
    brokers = EmbeddedBrokers(data_dir, durable=durable, host=config.brokers.host)
    await brokers.start()
    try:
        config.kafka.bootstrap = config.kafka.bootstrap or brokers.kafka_bootstrap
        config.nats.url = config.nats.url or brokers.nats_url
        if not durable:
            await restore(config.kafka, config.run_dir)
        log.info("reopened the run's log (%s): %s", data_dir if durable else "log/", brokers.kafka_bootstrap)
        yield config
    finally:
        brokers.stop()


class RecordGone(StreamforgeError):
    """A record located on a topic is no longer where it was (deleted meanwhile); not retriable."""

    def __init__(self, topic: str, partition: int, offset: int, ident: str) -> None:
        super().__init__(f"{ident} is gone from {topic} partition {partition} offset {offset}")
        self.topic, self.partition, self.offset, self.ident = topic, partition, offset, ident


def ident_of(msg: Any) -> str:
    """The id a record of the run's topics is known by (batch, episode or prompt id)."""
    for name in ("batch_id", "episode_id", "prompt_id"):
        value = getattr(msg, name, None)
        if value is not None:
            return value
    return ""


async def scan(kafka: Any, topic: str, *, expect: type | None = None, idle_s: float = 10.0) -> AsyncIterator[Any]:
    """Every retained record of ``topic`` (a ``topics.kafka.Received``, decoded), each partition from its first
    retained record to the high-water mark it had when read, without keeping any."""
    from topics.admin import reader_from_start

    consumer, tps = await reader_from_start(kafka, topic, client_id=f"{kafka.client_id}-scan", expect=expect)
    try:
        idle_since = time.monotonic()
        while True:
            records = await consumer.getmany(timeout_ms=300)
            for r in records:
                yield r
            if records:
                idle_since = time.monotonic()
            done = True
            for tp in tps:
                hw = consumer.highwater(tp)
                if hw is None or await consumer.position(tp) < hw:
                    done = False
            if done or time.monotonic() - idle_since > idle_s:
                return
    finally:
        await consumer.stop()


async def locate(kafka: Any, topic: str, wanted: set[str], *, expect: type) -> dict[str, tuple[int, int]]:
    """``{id: (partition, offset)}`` of the first retained record of each wanted id on ``topic`` (``ident_of``;
    the record key where a record does not decode); ids not found are absent."""
    found: dict[str, tuple[int, int]] = {}
    async with contextlib.aclosing(scan(kafka, topic, expect=expect)) as records:
        async for r in records:
            ident = ident_of(r.value) if r.value is not None else r.key
            if ident in wanted and ident not in found:
                found[ident] = (r.partition, r.offset)
                if len(found) == len(wanted):
                    break
    return found


async def records_at(kafka: Any, topic: str, plan: list[tuple[int, int, str]], *, expect: type,
                     idle_s: float = 10.0) -> AsyncIterator[Any]:
    """The decoded message at each ``(partition, offset, id)`` of ``plan``, in plan order, read forward per
    partition (a seek only where the plan goes back); ``RecordGone`` when one is not there (any more)."""
    from aiokafka import TopicPartition

    from topics import codec
    from topics.admin import reader_from_start

    consumer, _ = await reader_from_start(kafka, topic, client_id=f"{kafka.client_id}-at", expect=expect)
    ahead: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # read, not yet used
    first: dict[int, int] = {}
    for p, off, _ in plan:
        first.setdefault(p, off)
    for p, off in first.items():
        consumer.seek(TopicPartition(topic, p), off)
    try:
        for p, off, ident in plan:
            tp = TopicPartition(topic, p)
            queue = ahead[p]
            idle_since = time.monotonic()
            while True:
                while queue and queue[0].offset < off:
                    queue.popleft()
                if queue and queue[0].offset == off:
                    rec = queue.popleft()
                    break
                if queue:  # the plan went back on this partition
                    queue.clear()
                    consumer.seek(tp, off)
                got = (await consumer.raw.getmany(tp, timeout_ms=500)).get(tp, [])
                queue.extend(got)
                if got:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > idle_s:
                    raise RecordGone(topic, p, off, ident)
            try:
                msg = codec.decode(rec.value, max_bytes=kafka.max_message_bytes, expect=expect)
            except StreamforgeError:
                raise RecordGone(topic, p, off, ident) from None
            if ident_of(msg) != ident:
                raise RecordGone(topic, p, off, ident)
            yield msg
    finally:
        await consumer.stop()
