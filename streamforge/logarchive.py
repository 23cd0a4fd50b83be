"""The run's log archived in its directory while it runs, and restored into a fresh broker to reopen the run.

The embedded Tansu keeps a run's records in memory (its S3 store costs the demo several times its run time:
bench/RESULTS.md, ``bench/runlog.py``), so ``up`` copies every record of the run's topics, as it is written, into
``<run_dir>/log/``:

* ``<topic>/<partition>.msgpack``: the partition's records in offset order, each a msgpack map ``{"o": offset,
  "k": key (bin or nil), "v": value (bin), "h": [[name, bin], ...], "t": timestamp ms}`` appended and flushed
  (fsync at most every ``flush_s``); a record torn by a crash mid-write ends the file when it is read back;
* ``topics.json``: each topic's partition count and creation configs (``topics.retention_ms``...), written at start;
* ``groups.json``: the committed offsets of the run's consumer groups (``{group: {topic: {partition: offset}}}``),
  written when the archive is closed.

``Archiver`` is the copying loop (one group-less consumer assigned every partition of the run's topics, from
the offsets it has already archived); ``restore`` produces an archive back into an empty broker, partition by
partition in offset order (the broker gives them the same offsets, 0, 1, 2...: the records keep their keys,
headers and timestamps), and commits the groups' offsets. Only for the embedded broker: a real Kafka keeps its own
log (``topics.retention_ms``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import orjson
from aiokafka import TopicPartition

log = logging.getLogger("streamforge.logarchive")

LOG_DIR = "log"


def log_dir(run_dir: Path) -> Path:
    return Path(run_dir) / LOG_DIR


def iter_partition(path: Path) -> Any:
    """The records of one archived partition, in order, streamed (a torn last record ends it)."""
    with open(path, "rb") as fh:
        unpacker = msgpack.Unpacker(fh, raw=False, max_buffer_size=1 << 30)
        try:
            for rec in unpacker:
                if not (isinstance(rec, dict) and "o" in rec and "v" in rec):
                    return
                yield rec
        except (msgpack.OutOfData, msgpack.ExtraData, ValueError):
            return  # a record torn by a crash mid-write: the archive ends before it


def archived_end(path: Path) -> tuple[int, int]:
    """(the offset after the last complete record, the bytes those records take) of one archived partition."""
    nxt, size = 0, 0
    with open(path, "rb") as fh:
        unpacker = msgpack.Unpacker(fh, raw=False, max_buffer_size=1 << 30)
        try:
            for rec in unpacker:
                if not (isinstance(rec, dict) and "o" in rec and "v" in rec):
                    break
                nxt, size = rec["o"] + 1, unpacker.tell()
        except (msgpack.OutOfData, msgpack.ExtraData, ValueError):
            pass
    return nxt, size


def has_archive(run_dir: Path) -> bool:
    return (log_dir(run_dir) / "topics.json").exists()


class Archiver:
    """Copies the run's topics into ``<run_dir>/log`` (module docstring); ``run()`` is its loop."""

    def __init__(self, kafka: Any, names: Any, topics_cfg: Any, run_dir: Path, *, flush_s: float = 1.0) -> None:
        self.kafka, self.names, self.topics_cfg = kafka, names, topics_cfg
        self.dir = log_dir(run_dir)
        self.flush_s = flush_s
        self.records = 0
        self._files: dict[tuple[str, int], BinaryIO] = {}
        self._next: dict[tuple[str, int], int] = {}
        self._consumer: Any = None
        self.task: asyncio.Future | None = None  # the ``run`` loop, when started by ``start_archive``

    async def start(self) -> None:
        """Assign every partition of the run's topics at the offset after what is archived; write topics.json."""
        from topics.admin import partitions_of
        from topics.kafka import Consumer

        self.dir.mkdir(parents=True, exist_ok=True)
        self._consumer = Consumer(self.kafka, [], group_id=None, client_id=f"{self.kafka.client_id}-archive")
        await self._consumer.start()
        tps, meta = [], {}
        for topic in self.names.topics():
            parts = await partitions_of(self._consumer, topic)
            tps += parts
            meta[topic] = {"partitions": len(parts), "configs": self.topics_cfg.topic_configs(topic.split(".", 1)[1])}
        (self.dir / "topics.json").write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
        self._consumer.raw.assign(tps)
        for tp in tps:
            path = self._path(tp.topic, tp.partition)
            nxt = 0
            if path.exists():  # continue after what is archived, a torn tail dropped first
                nxt, size = archived_end(path)
                os.truncate(path, size)
            self._next[(tp.topic, tp.partition)] = nxt
            self._consumer.seek(tp, nxt)

    def _path(self, topic: str, partition: int) -> Path:
        return self.dir / topic / f"{partition}.msgpack"

    def _file(self, topic: str, partition: int) -> BinaryIO:
        fh = self._files.get((topic, partition))
        if fh is None:
            path = self._path(topic, partition)
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = self._files[(topic, partition)] = open(path, "ab")  # noqa: SIM115 - closed by close()
        return fh

    async def _copy(self, timeout_ms: int) -> int:
        batches = await self._consumer.raw.getmany(timeout_ms=timeout_ms)
        n = 0
        for tp, records in batches.items():
            fh = self._file(tp.topic, tp.partition)
            for r in records:
                fh.write(msgpack.packb({"o": r.offset, "k": r.key, "v": r.value or b"",
                                        "h": [[k, v] for k, v in (r.headers or ())], "t": r.timestamp or 0},
                                       use_bin_type=True))
                self._next[(tp.topic, tp.partition)] = r.offset + 1
                n += 1
        self.records += n
        return n

    def _flush(self) -> None:
        for fh in self._files.values():
            fh.flush()
            os.fsync(fh.fileno())

    async def run(self) -> None:
        """Copies every new record of the run's topics; waits on Kafka at most 500 ms at a time. Unblocked by a
        record; runs until cancelled (``close`` then copies what is left)."""
        last = time.monotonic()
        while True:
            await self._copy(500)
            if time.monotonic() - last >= self.flush_s:
                await asyncio.to_thread(self._flush)
                last = time.monotonic()

    async def close(self, *, timeout_s: float = 30.0) -> None:
        """Stop the loop, copy up to each partition's high-water mark, write groups.json, close the files.
        Idempotent."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        if self._consumer is None:
            return
        from topics.admin import group_offsets, highwaters

        try:
            marks = {(t, p): hw for t in self.names.topics() for p, hw in (await highwaters(self.kafka, t)).items()}
            deadline = time.monotonic() + timeout_s
            while any(self._next.get(k, 0) < hw for k, hw in marks.items()) and time.monotonic() < deadline:
                await self._copy(300)
            groups: dict[str, dict[str, dict[str, int]]] = {}
            for topic, group in self.names.consumer_groups().items():
                committed = await group_offsets(self.kafka, group, topic)
                if committed:
                    groups.setdefault(group, {})[topic] = {str(p): o for p, o in committed.items()}
            (self.dir / "groups.json").write_bytes(orjson.dumps(groups, option=orjson.OPT_INDENT_2))
        finally:
            self._flush()
            for fh in self._files.values():
                fh.close()
            self._files.clear()
            with contextlib.suppress(Exception):
                await self._consumer.stop()
            self._consumer = None
        log.info("archived %d records of the run's topics in %s", self.records, self.dir)


async def restore(kafka: Any, run_dir: Path) -> int:
    """Produce the archive of ``run_dir`` into the (empty) broker of ``kafka``: topics with their partitions and
    configs, every record at its own offset, then the groups' committed offsets. Returns the records restored."""
    from aiokafka import AIOKafkaProducer

    from topics.admin import create_topic, highwaters
    from topics.kafka import Consumer, client_kwargs

    src = log_dir(run_dir)
    meta = orjson.loads((src / "topics.json").read_bytes())
    for topic, info in meta.items():
        await create_topic(kafka, topic, info["partitions"], info["configs"])

    producer = AIOKafkaProducer(**client_kwargs(kafka, client_id=f"{kafka.client_id}-restore"), acks="all",
                                max_request_size=kafka.max_message_bytes, linger_ms=5)
    await producer.start()
    total = 0
    try:
        for topic, info in meta.items():
            for p in range(info["partitions"]):
                path = src / topic / f"{p}.msgpack"
                n, futures = 0, []
                for r in iter_partition(path) if path.exists() else ():
                    if r["o"] != n:
                        log.warning("%s[%d]: archived offset %d where %d was due: restored offsets differ",
                                    topic, p, r["o"], n)
                    futures.append(await producer.send(topic, r["v"], key=r["k"], partition=p,
                                                       timestamp_ms=r["t"] or None,
                                                       headers=[(k, v) for k, v in r["h"]] or None))
                    n += 1
                    if len(futures) >= 1000:
                        await asyncio.gather(*futures)
                        futures = []
                await asyncio.gather(*futures)
                total += n
                if n and (await highwaters(kafka, topic)).get(p) != n:
                    raise RuntimeError(f"restoring {topic}[{p}]: the broker does not hold its {n} records")
    finally:
        await producer.stop()
    groups_path = src / "groups.json"
    groups = orjson.loads(groups_path.read_bytes()) if groups_path.exists() else {}
    for group, topics in groups.items():
        offsets = {TopicPartition(t, int(p)): o for t, offs in topics.items() for p, o in offs.items()}
        consumer = Consumer(kafka, [], group_id=group, client_id=f"{kafka.client_id}-restore",
                            partitions=list(offsets))  # assigned, never joined: a commit of a group-less member
        await consumer.start()
        try:
            await consumer.commit(offsets)
        finally:
            await consumer.stop()
    log.info("restored %d records of %s", total, src)
    return total


async def start_archive(kafka: Any, names: Any, topics_cfg: Any, run_dir: Path) -> Archiver:
    """``up``'s side: restore the run's archive into the fresh broker if the run directory has one (a run taken
    up again), create the run's other topics, then start archiving (``Archiver.task``: ``up`` stops the run if
    it ends)."""
    from topics.admin import ensure_topics

    if has_archive(run_dir):
        await restore(kafka, run_dir)
    await ensure_topics(kafka, names, topics_cfg)
    archiver = Archiver(kafka, names, topics_cfg, run_dir)
    await archiver.start()
    archiver.task = asyncio.ensure_future(archiver.run())
    return archiver

