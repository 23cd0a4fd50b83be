"""Reproducer: the embedded broker (Tansu) serves records of a later produce request before an earlier one's are
readable, so a consumer at the tail of a partition steps over offsets it never receives.

No streamforge code is in the produce or the consume path: ``--producers`` processes, each one plain
``AIOKafkaProducer`` (pipelined sends, ``--linger-ms``, acks all), write records of ``--min-kb``..``--max-kb`` with
``--keys`` distinct keys to a topic of one partition for ``--seconds`` at ``--rate`` records per second in all (0:
as fast as they can). Two readers follow the partition's tail meanwhile:

* ``raw``: its own FetchRequests through aiokafka's ``AIOKafkaClient`` (min_bytes 1, ``--max-wait-ms``), the
  records' offsets parsed from the response. A fetch whose records skip an offset (the first returned beyond the
  requested one, or a hole between two returned) is a *gap*; the reader logs the requested offset, the offsets
  returned around the hole and the response's high-water mark, then fetches again from the first missing offset
  until it comes back, counting the re-fetches and the time it took (``healed``), or gives up after
  ``--heal-timeout-s`` (``never_healed``).
* ``client``: a plain ``AIOKafkaConsumer`` (``assign``, ``getmany``), as streamforge's buffer reads: every offset
  its records step over is counted (``client_skipped``); it does not look back.

After the producers stop, a fresh consumer reads the partition from offset 0 and every acknowledged offset is
looked for (``missing_at_end``: acknowledged offsets the broker cannot serve at all).

Why (Tansu 0.6.0, ``tansu-storage/src/dynostore.rs``, the ``memory://`` and ``s3://`` engines alike): ``produce``
first advances the partition's high-water mark (its offset reservation) and only then writes the record batch as an
object; ``fetch`` lists the batch objects below the high-water mark from the requested offset on. While the batch
of one produce request is not written yet, the batch of a concurrent later one (another connection) is listed and
served: the reservation's offsets are a hole in that response. The batch is written a moment later; a client that
accepted the response has moved past it (Kafka clients accept records beyond the requested offset, which
compaction leaves on a real Kafka).

Usage: ``python bench/tansu_gaps.py [--producers 2] [--seconds 30] [--rate 0] [--min-kb 9] [--max-kb 60]
[--keys 256] [--linger-ms 5] [--durable]``. Last line: ``{"bench": "tansu_gaps", "produced": N, "gaps": G,
"gaps_per_10k": R, "healed": H, "never_healed": U, "client_skipped": S, "missing_at_end": M, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.memory_records import MemoryRecords

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamforge.brokers import EmbeddedBrokers

TOPIC = "gaps"
MAX_BYTES = 16 * 1024 * 1024


# -- producers (each in a process of its own) ---------------------------------------------------------------------
def _produce(bootstrap: str, seconds: float, rate: float, min_kb: float, max_kb: float, keys: int,
             linger_ms: int, seed: int, out: str) -> None:
    asyncio.run(_produce_async(bootstrap, seconds, rate, min_kb, max_kb, keys, linger_ms, seed, out))


async def _produce_async(bootstrap: str, seconds: float, rate: float, min_kb: float, max_kb: float, keys: int,
                         linger_ms: int, seed: int, out: str) -> None:
    rng = random.Random(seed)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=linger_ms,
                                max_request_size=MAX_BYTES)
    await producer.start()
    payload = rng.randbytes(int(max_kb * 1024))
    acked: list[int] = []
    pending: set[asyncio.Future] = set()

    def on_ack(fut: asyncio.Future) -> None:
        pending.discard(fut)
        if not fut.cancelled() and fut.exception() is None:
            acked.append(fut.result().offset)

    t0 = time.monotonic()
    sent = 0
    while (now := time.monotonic()) - t0 < seconds:
        if rate > 0 and sent >= rate * (now - t0):
            await asyncio.sleep(1 / rate)
            continue
        if len(pending) >= 256:  # bounded pipelining: a generator process's groups in flight
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            continue
        size = int(rng.uniform(min_kb, max_kb) * 1024)
        fut = await producer.send(TOPIC, payload[:size], key=f"g{rng.randrange(keys)}".encode(), partition=0)
        pending.add(fut)
        fut.add_done_callback(on_ack)
        sent += 1
    if pending:
        await asyncio.wait(pending)
    await producer.stop()
    Path(out).write_text(json.dumps({"sent": sent, "acked": acked}))


# -- the raw reader: its own FetchRequests -------------------------------------------------------------------------
def _offsets(message_set: bytes) -> list[int]:
    records = MemoryRecords(message_set)
    out = []
    while records.has_next():
        batch = records.next_batch()
        if batch is None:
            break
        out.extend(r.offset for r in batch)
    return out


class RawReader:
    """Follows partition 0 with raw FetchRequests; records every gap a response holds and how it healed."""

    def __init__(self, bootstrap: str, *, max_wait_ms: int, heal_timeout_s: float) -> None:
        self.bootstrap = bootstrap
        self.max_wait_ms = max_wait_ms
        self.heal_timeout_s = heal_timeout_s
        self.position = 0
        self.fetches = 0
        self.gaps: list[dict] = []

    async def _fetch(self, client: AIOKafkaClient, node: int, offset: int) -> tuple[list[int], int]:
        req = FetchRequest(self.max_wait_ms, 1, MAX_BYTES, 0, [(TOPIC, [(0, offset, MAX_BYTES)])])
        resp = await client.send(node, req)
        self.fetches += 1
        for _topic, parts in resp.topics:
            for _partition, error_code, highwater, *rest in parts:
                if error_code:
                    raise RuntimeError(f"fetch at {offset}: error code {error_code}")
                return [o for o in _offsets(rest[-1]) if o >= offset], highwater
        return [], -1

    async def run(self, stop: asyncio.Event) -> None:
        """Reads until ``stop`` is set and the position has reached the high-water mark."""
        client = AIOKafkaClient(bootstrap_servers=self.bootstrap)
        await client.bootstrap()
        try:
            await client.force_metadata_update()
            node = client.cluster.leader_for_partition(TopicPartition(TOPIC, 0))
            highwater = 0
            while not (stop.is_set() and self.position >= highwater):
                requested = self.position
                offsets, highwater = await self._fetch(client, node, requested)
                expected = requested
                for i, off in enumerate(offsets):
                    if off != expected:  # a hole: [expected, off) never came in this response
                        await self._heal(client, node, {
                            "requested": requested, "missing_from": expected, "missing_to": off - 1,
                            "returned_before": offsets[i - 1] if i else None, "returned_after": off,
                            "first_returned": offsets[0], "records_returned": len(offsets),
                            "highwater": highwater, "at": time.time()})
                        break  # read again from the hole
                    expected = off + 1
                self.position = expected
        finally:
            await client.close()

    async def _heal(self, client: AIOKafkaClient, node: int, gap: dict) -> None:
        """Fetch from the first missing offset again until it is served (or ``heal_timeout_s`` passes)."""
        t0 = time.monotonic()
        refetches = 0
        while time.monotonic() - t0 < self.heal_timeout_s:
            refetches += 1
            offsets, _ = await self._fetch(client, node, gap["missing_from"])
            if offsets and offsets[0] == gap["missing_from"]:
                gap.update(healed=True, refetches=refetches, heal_ms=round(1000 * (time.monotonic() - t0), 3))
                self.gaps.append(gap)
                return
        gap.update(healed=False, refetches=refetches, heal_ms=None)
        self.gaps.append(gap)


# -- the client reader: a plain AIOKafkaConsumer -------------------------------------------------------------------
async def client_reader(bootstrap: str, stop: asyncio.Event, max_wait_ms: int, out: dict) -> None:
    """Counts the offsets a plain consumer's records step over (it never looks back)."""
    tp = TopicPartition(TOPIC, 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                                fetch_max_wait_ms=max_wait_ms, max_partition_fetch_bytes=MAX_BYTES,
                                fetch_max_bytes=MAX_BYTES)
    await consumer.start()
    consumer.assign([tp])
    expected, skipped, holes, records = 0, 0, [], 0
    try:
        while True:
            batches = await consumer.getmany(tp, timeout_ms=200)
            for rec in batches.get(tp, []):
                records += 1
                if rec.offset != expected:
                    skipped += rec.offset - expected
                    holes.append([expected, rec.offset - 1])
                expected = rec.offset + 1
            hw = consumer.highwater(tp)
            if stop.is_set() and hw is not None and expected >= hw:
                break
    finally:
        await consumer.stop()
    out.update(client_records=records, client_skipped=skipped, client_holes=holes[:20])


async def read_all(bootstrap: str) -> set[int]:
    """Every offset a fresh consumer reads from 0 to the high-water mark, once the producers are done."""
    tp = TopicPartition(TOPIC, 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=MAX_BYTES, fetch_max_bytes=MAX_BYTES)
    await consumer.start()
    consumer.assign([tp])
    seen: set[int] = set()
    try:
        idle = 0
        while idle < 5:
            batches = await consumer.getmany(tp, timeout_ms=500)
            recs = batches.get(tp, [])
            seen.update(r.offset for r in recs)
            hw = consumer.highwater(tp)
            idle = idle + 1 if not recs and hw is not None and await consumer.position(tp) >= hw else 0
    finally:
        await consumer.stop()
    return seen


async def main_async(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="tansu-gaps-") as tmp:
        brokers = EmbeddedBrokers(Path(tmp) / "brokers", durable=args.durable)
        await brokers.start()
        try:
            bootstrap = brokers.kafka_bootstrap
            admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
            await admin.start()
            await admin.create_topics([NewTopic(TOPIC, num_partitions=1, replication_factor=1)])
            await admin.close()
            stop = asyncio.Event()
            raw = RawReader(bootstrap, max_wait_ms=args.max_wait_ms, heal_timeout_s=args.heal_timeout_s)
            client_out: dict = {}
            readers = [asyncio.ensure_future(raw.run(stop))]
            if not args.no_client:
                readers.append(asyncio.ensure_future(client_reader(bootstrap, stop, args.max_wait_ms, client_out)))
            ctx = multiprocessing.get_context("spawn")
            outs = [str(Path(tmp) / f"producer{i}.json") for i in range(args.producers)]
            procs = [ctx.Process(target=_produce, args=(bootstrap, args.seconds, args.rate / args.producers,
                                                        args.min_kb, args.max_kb, args.keys, args.linger_ms, i, out))
                     for i, out in enumerate(outs)]
            t0 = time.monotonic()
            for p in procs:
                p.start()
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(None, p.join, args.seconds + 60) for p in procs))
            wall = time.monotonic() - t0
            stop.set()
            await asyncio.gather(*readers)
            acked = sorted(o for out in outs for o in json.loads(Path(out).read_text())["acked"])
            sent = sum(json.loads(Path(out).read_text())["sent"] for out in outs)
            seen = await read_all(bootstrap)
        finally:
            brokers.stop()
    heals = [g["heal_ms"] for g in raw.gaps if g["healed"]]
    refetches = [g["refetches"] for g in raw.gaps if g["healed"]]
    missing = sorted(set(acked) - seen)
    return {
        "bench": "tansu_gaps", "producers": args.producers, "seconds": args.seconds, "rate": args.rate,
        "kb": [args.min_kb, args.max_kb], "linger_ms": args.linger_ms, "durable": args.durable,
        "max_wait_ms": args.max_wait_ms, "wall_s": round(wall, 1), "sent": sent, "produced": len(acked),
        "produced_per_s": round(len(acked) / wall, 1), "fetches": raw.fetches, "gaps": len(raw.gaps),
        "gaps_per_10k": round(1e4 * len(raw.gaps) / max(1, len(acked)), 2),
        "gap_records": sum(g["missing_to"] - g["missing_from"] + 1 for g in raw.gaps),
        "gaps_at_fetch_start": sum(1 for g in raw.gaps if g["returned_before"] is None),
        "healed": len(heals), "never_healed": sum(1 for g in raw.gaps if not g["healed"]),
        "heal_ms_median": round(statistics.median(heals), 3) if heals else None,
        "heal_ms_max": max(heals) if heals else None,
        "refetches_max": max(refetches) if refetches else None,
        **{k: v for k, v in client_out.items() if k != "client_holes"},
        "missing_at_end": len(missing), "missing_sample": missing[:10],
        "gap_sample": raw.gaps[:3], "client_holes_sample": client_out.get("client_holes", [])[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--producers", type=int, default=2, help="producer processes (one connection each)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=0.0, help="records per second in all (0: as fast as possible)")
    ap.add_argument("--min-kb", type=float, default=9.0)
    ap.add_argument("--max-kb", type=float, default=60.0)
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--linger-ms", type=int, default=5)
    ap.add_argument("--max-wait-ms", type=int, default=50, help="the readers' fetch max wait (kafka.fetch_max_wait_ms)")
    ap.add_argument("--heal-timeout-s", type=float, default=10.0)
    ap.add_argument("--durable", action="store_true", help="Tansu's s3:// engine over SeaweedFS instead of memory://")
    ap.add_argument("--no-client", action="store_true", help="only the raw reader")
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
