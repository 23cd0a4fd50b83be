"""Benchmark: episodes/s through the replay buffer vs raw aiokafka produce+consume of the same bytes.

One run, two measurements with the same topology, each on embedded brokers (Tansu + nats-server) started for it
alone:

* raw:    this process produces the encoded episodes (the same bytes, keyed by group_id) to a topic; a child
          process consumes them with a plain aiokafka consumer (no decoding) with the buffer's consumer settings
          (``kafka.fetch_max_wait_ms``, ``buffer.fetch_min_bytes``, ``buffer.poll_max_records``). Episodes/s = N / (time from the
          first send to the child's last record).
* buffer: this process produces the same bytes to the run's ``episodes`` topic; a child process runs the buffer
          (``streamforge run buffer``: decode, dedup, group, advantages, build and publish Batches, commit);
          another child reads the ``batches`` topic (a process of its own, as the raw consumer: in this one it
          took CPU from the producer's event loop; its fetches wait for ``--reader-fetch-min-bytes``, 1 MiB, so
          that the observer's polling does not load the broker). Episodes/s = N / (time from the first send until every
          episode is in a batch the reader has read).

Children are started and ready (partitions assigned; the buffer's recovery check of them done, which on these
fresh topics finds nothing to recover) before the clock starts. Every consumer here, raw or not,
waits at most ``kafka.fetch_max_wait_ms`` per fetch (a Tansu fetch that finds no record waits that long, even if
records arrive meanwhile). Last line: ``{"bench": "bus", "episodes_per_s_vs_raw": X}`` (goal: >= 0.8).

Runs come in (raw, buffer) pairs measured back to back, the order alternating (raw first, then buffer first...),
each run on brokers of its own (Tansu's memory store slows as it fills, so on one shared broker the later run of
a pair paid for the earlier ones' data); the reported ratio is the median over the pairs, which damps the load
drift of a shared machine. The default 64,000 episodes make the buffer's fixed tail (the last, partial batches
wait ``max_batch_wait_s``, 0.5 s here) a small part of a run: at 16,000 the raw path took about 1.1 s in all.
The detail line also gives the CPU seconds of this process, the broker and the children per run (``child``: the raw consumer
or the buffer; ``reader``: the batches reader), ``after_last_ack_s`` (seconds from the producer's last
acknowledgement to the end of the measurement: the pipeline's tail, which for the buffer includes the
``max_batch_wait_s`` of the last, partial, batches), and
``cpu_efficiency_vs_raw`` (median of raw CPU / buffer CPU): the ratio a machine with idle cores would approach.

The episodes producer (both paths) sends record batches of aiokafka's default 16 KiB, as the generators do
(``--producer-batch-bytes`` changes it): at that size a produce request carries about five episodes, and the
broker's and the producer's cost per request dominate both paths (raw 4,000-8,200 episodes/s). With 1 MiB
batches the same run moves 45,000-60,000 episodes/s raw and the buffer path is bound by the buffer role's CPU
(about 23 us an episode against the raw consumer's 5): see the README for what each regime gives.

``--buffers N`` runs N buffer processes in one consumer group (they split the episodes partitions; the clock
starts once their assignments have settled), to see the buffer scale out where there are cores for it.

Usage: ``python bench/bus.py [--episodes N] [--group-size G] [--prompt-len P] [--response-len R] [--repeats K]
[--producer-batch-bytes B] [--buffers N] [--set SECTION.KEY=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgpack
from aiokafka import AIOKafkaConsumer, TopicPartition

from buffer.synthetic import make_group
from streamforge.brokers import EmbeddedBrokers
from streamforge.config import dump_config, load_config
from topics import codec
from topics.admin import ensure_topics
from topics.kafka import Producer


def make_config(brokers: EmbeddedBrokers, prefix: str, run_dir: Path, extra: list[str] = ()):  # type: ignore[assignment]
    return load_config(None, [
        f"--run.prefix={prefix}", f"--run.run_dir={run_dir}", f"--kafka.bootstrap={brokers.kafka_bootstrap}",
        f"--nats.url={brokers.nats_url}", "--telemetry.traces=none",
        # no trainer here: nothing consumes batches, so the buffer's bounds from the trainer's progress are off
        "--staleness.max_versions=-1", "--buffer.max_batches_ahead=0", *extra, *COMMON,  # --set wins
    ], environ={})


COMMON: list[str] = []  # overrides shared by both paths (--compression, --set)
PRODUCER_BATCH_BYTES = 0  # the episodes producer's record batch (--producer-batch-bytes; 0: aiokafka's 16 KiB)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc); 0 when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class CpuMeter:
    """CPU seconds spent by this process, the broker and the children between ``start`` and ``stop``."""

    def __init__(self, broker_pid: int) -> None:
        self.broker_pid = broker_pid
        self.children: dict[str, int] = {}

    def _now(self) -> tuple[float, ...]:
        t = os.times()
        return (t.user + t.system, cpu_s(self.broker_pid), *(cpu_s(pid) for pid in self.children.values()))

    def start(self, **children: int) -> None:
        self.children = children
        self._t0 = self._now()

    def stop(self) -> dict[str, float]:
        keys = ("main", "broker", *self.children)
        return {k: round(b - a, 2) for k, a, b in zip(keys, self._t0, self._now())}


async def produce(cfg, topic: str, payloads: list[tuple[str, bytes]]) -> tuple[float, float]:
    """Send every payload (pipelined, acks awaited); returns the wall times of the first send and the last ack."""
    async with Producer(cfg.kafka, client_id="bench-producer", max_batch_bytes=PRODUCER_BATCH_BYTES) as producer:
        t0 = time.time()
        futs = [await producer.enqueue_raw(topic, value, key=key) for key, value in payloads]
        await asyncio.gather(*futs)
        return t0, time.time()


# -- raw consumer child -------------------------------------------------------------------------------------

async def raw_consumer(bootstrap: str, topic: str, n: int, fetch_max_wait_ms: int, fetch_min_bytes: int,
                       max_records: int) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                fetch_max_wait_ms=fetch_max_wait_ms, fetch_min_bytes=fetch_min_bytes,
                                fetch_max_bytes=52428800, max_partition_fetch_bytes=16 * 1024 * 1024)
    await consumer.start()
    try:
        await consumer.topics()
        parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, 0)
        print("ready", flush=True)
        got, nbytes = 0, 0
        while got < n:
            batches = await consumer.getmany(timeout_ms=500, max_records=max_records)
            for records in batches.values():
                got += len(records)
                nbytes += sum(len(r.value) for r in records)
        print(f"done {time.time():.6f} {got} {nbytes}", flush=True)
    finally:
        await consumer.stop()


async def measure_raw(cfg, payloads: list[tuple[str, bytes]], meter: CpuMeter) -> tuple[float, dict]:
    topic = cfg.names.episodes
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--raw-consumer", cfg.kafka.bootstrap, topic, str(len(payloads)),
        str(cfg.kafka.fetch_max_wait_ms), str(cfg.buffer.fetch_min_bytes), str(cfg.buffer.poll_max_records),
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )
    assert child.stdout is not None
    line = await asyncio.wait_for(child.stdout.readline(), 60)
    assert line.strip() == b"ready", line
    meter.start(child=child.pid)
    t0, t_acked = await produce(cfg, topic, payloads)
    line = await asyncio.wait_for(child.stdout.readline(), 300)
    cpu = meter.stop()
    await child.wait()
    t_end = float(line.split()[1])
    return len(payloads) / (t_end - t0), cpu, t_end - t_acked


# -- batches reader child -----------------------------------------------------------------------------------

async def batch_reader(bootstrap: str, topic: str, n: int, fetch_max_wait_ms: int, max_partition_bytes: int,
                       fetch_min_bytes: int) -> None:
    """Reads ``topic`` (partition 0) from the start until ``n`` episodes are in the batches read.

    Its fetches wait for ``fetch_min_bytes`` (or ``fetch_max_wait_ms``): this reader only observes when the batches
    are there, and at one byte its fetches, each answered with a batch or two, cost the broker about a second of
    CPU a run (6.4-6.5 s against 7.1-7.7 s), CPU the raw path, which has no such reader, never pays."""
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, client_id="bench-batches", group_id=None,
                              enable_auto_commit=False, fetch_max_bytes=52428800,
                              fetch_max_wait_ms=fetch_max_wait_ms, max_partition_fetch_bytes=max_partition_bytes,
                              fetch_min_bytes=fetch_min_bytes)
    await reader.start()
    try:
        tp = TopicPartition(topic, 0)
        reader.assign([tp])
        reader.seek(tp, 0)
        print("ready", flush=True)
        got, batches = 0, 0
        while got < n:
            for records in (await reader.getmany(timeout_ms=500)).values():
                for rec in records:
                    got += len(msgpack.unpackb(rec.value, raw=False)["episode_ids"])
                    batches += 1
        print(f"done {time.time():.6f} {got} {batches}", flush=True)
    finally:
        await reader.stop()


# -- buffer path ----------------------------------------------------------------------------------------------

_ASSIGNED = re.compile(r"assigned \[([0-9, ]*)\];")


def _tails(logs: list[Path]) -> str:
    """The end of each buffer's log, for an error message."""
    return "\n".join(path.read_text(errors="replace")[-1500:] for path in logs)


async def wait_for_assignment(logs: list[Path], procs: list[subprocess.Popen], partitions: int,
                              timeout_s: float) -> None:
    """Until the buffers' latest completed assignments (the line each logs once its assignment handling, recovery
    included, is done) split the partitions between them, and still do half a second later (no rebalance left).
    Waiting only for assignment to start, the producer's first records made a buffer scan its outputs inside the
    measurement (0.75 s at fetch_max_wait_ms=50, 2.2 s at 500)."""
    deadline = time.monotonic() + timeout_s
    settled: list[list[int]] | None = None
    while True:
        latest = []
        for path in logs:
            found = _ASSIGNED.findall(path.read_text(errors="replace"))
            latest.append(sorted(int(p) for p in found[-1].split(",") if p.strip()) if found else [])
        owned = sorted(p for parts in latest for p in parts)
        if owned == list(range(partitions)) and all(latest):
            if settled == latest:
                return
            settled = latest
        else:
            settled = None
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"buffers not ready:\n{_tails(logs)}")
        await asyncio.sleep(0.5)


async def measure_buffer(cfg, payloads: list[tuple[str, bytes]], workdir: Path, meter: CpuMeter,
                         reader_fetch_min_bytes: int, buffers: int = 1) -> tuple[float, int, dict, float]:
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / "buffer.yaml"
    cfg_path.write_text(dump_config(cfg))
    logs = [workdir / f"buffer{i}.log" for i in range(buffers)]
    procs: list[subprocess.Popen] = []
    for log_path in logs:  # one consumer group: the buffers split the episodes partitions
        with open(log_path, "wb") as log:  # noqa: ASYNC230 (before the clock starts)
            procs.append(subprocess.Popen(  # noqa: ASYNC220
                [sys.executable, "-m", "streamforge", "run", "buffer", "--config", str(cfg_path)], cwd=ROOT,
                stdout=log, stderr=subprocess.STDOUT))
    try:
        await wait_for_assignment(logs, procs, cfg.topics.episodes_partitions, 90 + 30 * buffers)
        reader = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--batch-reader", cfg.kafka.bootstrap, cfg.names.batches, str(len(payloads)),
            str(cfg.kafka.fetch_max_wait_ms), str(cfg.kafka.max_message_bytes + 65536), str(reader_fetch_min_bytes),
            stdout=asyncio.subprocess.PIPE, cwd=ROOT,
        )
        try:
            assert reader.stdout is not None
            line = await asyncio.wait_for(reader.stdout.readline(), 60)
            assert line.strip() == b"ready", line
            children = {"child": procs[0].pid} if buffers == 1 else {f"child{i + 1}": p.pid for i, p in enumerate(procs)}
            meter.start(**children, reader=reader.pid)
            sending = asyncio.ensure_future(produce(cfg, cfg.names.episodes, payloads))
            done = asyncio.ensure_future(reader.stdout.readline())
            deadline = time.monotonic() + 300
            while not done.done():  # the buffers' health, checked while the reader reads
                await asyncio.wait([done], timeout=0.5)
                if not done.done() and (time.monotonic() > deadline or any(p.poll() is not None for p in procs)):
                    done.cancel()
                    raise RuntimeError(f"episodes not all batched:\n{_tails(logs)}")
            cpu = meter.stop()
            t0, t_acked = await sending
            _, t_end, _, batches = done.result().split()
            t_end, batches = float(t_end), int(batches)
        finally:
            if reader.returncode is None:
                reader.kill()
            await reader.wait()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    return len(payloads) / (t_end - t0), batches, cpu, t_end - t_acked


async def on_fresh_brokers(workdir: Path, fn: Any) -> Any:
    """Run ``fn(brokers)`` on brokers started for it alone, then stop them: every measurement meets a broker in
    the same state (Tansu's memory store slows as it fills: on one shared broker, whichever path ran later in
    a pair paid for the data of every earlier run)."""
    brokers = EmbeddedBrokers(workdir)
    await brokers.start()
    try:
        return await fn(brokers, CpuMeter(brokers._procs["tansu"].pid))
    finally:
        brokers.stop()


async def run(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="bench-bus-"))
    buffer_overrides = [
        f"--buffer.groups_per_batch={args.groups_per_batch}", "--buffer.max_batch_wait_s=0.5",
        "--buffer.poll_max_records=2000", "--buffer.max_pending_episodes=20000",
    ]
    groups = args.episodes // args.group_size
    payloads = [
        (e.group_id, codec.encode(e))
        for g in range(groups)
        for e in make_group(f"g{g}", args.group_size, prompt_len=args.prompt_len,
                            response_len=args.response_len, rewards=[float(i % 3) for i in range(args.group_size)])
    ]

    async def raw(brokers: EmbeddedBrokers, meter: CpuMeter) -> tuple:
        cfg = make_config(brokers, "benchraw", workdir / f"raw{r}", buffer_overrides)  # same consumer settings
        await ensure_topics(cfg.kafka, cfg.names, cfg.topics)
        return await measure_raw(cfg, payloads, meter)

    async def buf(brokers: EmbeddedBrokers, meter: CpuMeter) -> tuple:
        cfg = make_config(brokers, "benchbuf", workdir / f"buf{r}", buffer_overrides)
        await ensure_topics(cfg.kafka, cfg.names, cfg.topics)
        return await measure_buffer(cfg, payloads, workdir / f"buf{r}", meter, args.reader_fetch_min_bytes,
                                    args.buffers)

    raws, bufs = [], []
    for r in range(args.repeats):  # pairs back to back, the order alternating, each run on its own fresh brokers
        for path in ((raw, buf) if r % 2 == 0 else (buf, raw)):
            result = await on_fresh_brokers(workdir / f"brokers-{path.__name__}{r}", path)
            (raws if path is raw else bufs).append(result)
    pair_ratios = [b[0] / r[0] for r, b in zip(raws, bufs)]
    cpu_ratios = [sum(r[1].values()) / max(1e-9, sum(b[2].values())) for r, b in zip(raws, bufs)]
    return {"episodes": len(payloads), "episode_bytes": sum(len(v) for _, v in payloads) // len(payloads),
            "raw_episodes_per_s": [round(r[0], 1) for r in raws],
            "buffer_episodes_per_s": [round(b[0], 1) for b in bufs], "batches": bufs[0][1],
            "pair_ratios": [round(x, 3) for x in pair_ratios],
            "cpu_s_raw": [r[1] for r in raws], "cpu_s_buffer": [b[2] for b in bufs],
            "after_last_ack_s": {"raw": [round(r[2], 3) for r in raws], "buffer": [round(b[3], 3) for b in bufs]},
            "cpu_efficiency_vs_raw": round(statistics.median(cpu_ratios), 3),
            "ratio": statistics.median(pair_ratios)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-consumer":
        asyncio.run(raw_consumer(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--batch-reader":
        asyncio.run(batch_reader(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3, help="alternating raw/buffer pairs; the median ratio counts")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="extra config override for both paths (repeatable), e.g. buffer.output_compression=none")
    parser.add_argument("--reader-fetch-min-bytes", type=int, default=1 << 20,
                        help="fetch_min_bytes of the batches reader (it waits at most kafka.fetch_max_wait_ms)")
    parser.add_argument("--compression", default="", help="kafka.compression for both paths (default: config's)")
    parser.add_argument("--buffers", type=int, default=1,
                        help="buffer processes sharing the episodes partitions (one consumer group)")
    parser.add_argument("--producer-batch-bytes", type=int, default=0,
                        help="record batch of the episodes producer, both paths (0: aiokafka's 16 KiB, as the "
                             "generators use)")
    args = parser.parse_args()
    global PRODUCER_BATCH_BYTES
    PRODUCER_BATCH_BYTES = args.producer_batch_bytes
    if args.compression:
        COMMON.append(f"--kafka.compression={args.compression}")
    COMMON.extend(f"--{item}" for item in args.set)
    out = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in out.items() if k != "ratio"}))
    print(json.dumps({"bench": "bus", "episodes_per_s_vs_raw": round(out["ratio"], 3)}))


if __name__ == "__main__":
    main()
