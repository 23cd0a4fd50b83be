"""Buffer processes under failure: SIGKILL mid-stream and restart; two processes sharing the partitions.

Each buffer is a real subprocess: ``python -m streamforge run buffer --config C`` (``run_service(build_role("buffer", cfg))``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from buffer.synthetic import make_group
from helpers.audits import assert_nothing_lost
from runtime.telemetry import read_spans
from streamforge.audit import run_audit
from streamforge.config import dump_config
from streamforge.staleness import StalenessConfig
from topics.admin import read_topic
from topics.kafka import Producer
from topics.schemas import Batch

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]


def buffer_config(run_config, *, max_batch_wait_s: float = 0.5):
    cfg = dataclasses.replace(
        run_config,
        buffer=dataclasses.replace(run_config.buffer, groups_per_batch=2, max_batch_wait_s=max_batch_wait_s,
                                   group_timeout_s=60.0, max_batches_ahead=0),  # no trainer: no cap
        staleness=StalenessConfig(max_versions=-1),
        kafka=dataclasses.replace(run_config.kafka, session_timeout_ms=6000, heartbeat_interval_ms=1000),
    )
    return cfg


class BufferProcess:
    """One ``streamforge run buffer`` child with its log in a file."""

    def __init__(self, cfg, tmp: Path, name: str) -> None:
        self.name = name
        path = tmp / f"{name}.yaml"
        path.write_text(dump_config(cfg))
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open for the child's lifetime
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamforge", "run", "buffer", "--config", str(path),
             f"--buffer.buffer_id={name}"],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def assigned(self) -> list[list[int]]:
        return [[int(p) for p in re.findall(r"\d+", m)] for m in re.findall(r"partitions assigned \[([\d, ]*)\]", self.log())]

    def recovered(self) -> int:
        return sum(int(n) for n in re.findall(r"(\d+) decided episodes recovered", self.log()))

    async def wait_assigned(self, timeout_s: float, n: int | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.assigned()
            if got and got[-1] and (n is None or len(got[-1]) == n):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not assigned after {timeout_s} s:\n{self.log()[-3000:]}")
            await asyncio.sleep(0.2)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def traceparent(ep) -> bytes:
    """A W3C traceparent as a generator would send it: one trace per group, one span per episode."""
    trace_id = hashlib.sha256(ep.group_id.encode()).hexdigest()[:32]
    span_id = hashlib.sha256(ep.episode_id.encode()).hexdigest()[:16]
    return f"00-{trace_id}-{span_id}-01".encode()


async def produce_interleaved(cfg, waves: int, groups_per_wave: int, pause_s: float,
                              gate: asyncio.Event | None = None, gate_at: int = 0) -> int:
    """Each wave sends the first half of its groups and the second half of the previous wave's groups, so at
    any moment some groups are open (holding the committed offset back) while later ones are batched.
    With ``gate``, waves from ``gate_at`` on wait for it (so an event is sure to happen mid-stream)."""
    size = 4
    total = 0
    async with Producer(cfg.kafka) as producer:
        prev: list = []
        for w in range(waves + 1):
            if gate is not None and w == gate_at:
                await gate.wait()
            cur = [make_group(f"w{w}g{k}", size, rewards=[0, 1, k % 2, 1]) for k in range(groups_per_wave)] \
                if w < waves else []
            records = [e for g in cur for e in g[:2]] + [e for g in prev for e in g[2:]]
            futs = [await producer.enqueue(cfg.names.episodes, e, key=e.group_id, headers=[("traceparent", traceparent(e))])
                    for e in records]
            await asyncio.gather(*futs)
            total += len(records)
            prev = cur
            await asyncio.sleep(pause_s)
    return total


async def wait_all_decided(cfg, expected: int, timeout_s: float, procs) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        audit = await run_audit(cfg)
        if audit["produced"] == expected and audit["lost"] == 0 and audit["pending"] == 0:
            return audit
        for p in procs:
            if p.proc.poll() is not None:
                raise AssertionError(f"{p.name} exited {p.proc.returncode}:\n{p.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not every episode decided: {audit}")
        await asyncio.sleep(1.0)


async def write_dedup_ledger(cfg) -> list[str]:
    """The ledger of a trainer that trains each batch it reads once, skipping batch ids it already trained."""
    seen: list[str] = []
    for rec in await read_topic(cfg.kafka, cfg.names.batches, expect=Batch):
        if rec.value.batch_id not in seen:
            seen.append(rec.value.batch_id)
    path = cfg.run_dir / "trainer" / "ledger.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(
        orjson.dumps({"step": step, "policy_version": step, "batch_ids": [batch_id], "time": 0.0}) + b"\n"
        for step, batch_id in enumerate(seen, 1)))
    return seen


async def test_sigkill_mid_stream_then_restart_loses_nothing_trains_nothing_twice(run_config, tmp_path):
    cfg = buffer_config(run_config)
    a = BufferProcess(cfg, tmp_path, "buf-a")
    b = None
    try:
        await a.wait_assigned(60)
        killed = asyncio.Event()
        producing = asyncio.create_task(produce_interleaved(cfg, waves=10, groups_per_wave=6, pause_s=0.2,
                                                            gate=killed, gate_at=5))
        # kill once a few batches are out, while groups are still open (the second half of the stream waits)
        deadline = time.monotonic() + 60
        while len(await read_topic(cfg.kafka, cfg.names.batches)) < 4:
            assert time.monotonic() < deadline and a.proc.poll() is None, a.log()[-3000:]
            await asyncio.sleep(0.2)
        a.kill()
        killed.set()
        b = BufferProcess(cfg, tmp_path, "buf-b")
        expected = await producing
        await wait_all_decided(cfg, expected, 90, [b])
        await write_dedup_ledger(cfg)
        audit = await run_audit(cfg)
    finally:
        a.terminate()
        if b is not None:
            assert b.terminate() == 0, b.log()[-3000:]
    assert_nothing_lost(audit, prompts="none")  # episodes fed straight to the topic: no prompt to account for
    assert audit["batched"] == expected  # every group here has reward variance: all of it is batched
    assert audit["trained_twice"] == 0 and audit["trained"] == expected, audit
    assert audit["in_two_batches"] == 0 and audit["batched_and_dropped"] == 0, audit
    # the restarted buffer replayed records whose batches were already out, and skipped them
    assert b.recovered() > 0, b.log()[-3000:]
    # its batch spans link to the episodes' producer spans (one trace per group)
    spans = [sp for sp in read_spans(cfg.run_dir / "traces.jsonl") if sp["name"] == "buffer.batch"]
    assert spans and all(sp["service"] == "buffer" for sp in spans)
    for sp in spans:
        groups = sp["attributes"]["buffer.groups"]
        want = {hashlib.sha256(g.encode()).hexdigest()[:32] for g in groups}
        assert {lk["trace_id"] for lk in sp["links"]} == want and len(sp["links"]) == 4 * len(groups)


async def test_two_buffer_processes_share_partitions_and_produce_every_batch_once(run_config, tmp_path):
    cfg = buffer_config(run_config, max_batch_wait_s=5.0)  # partial batches only at the end of the stream
    procs = [BufferProcess(cfg, tmp_path, "buf-1"), BufferProcess(cfg, tmp_path, "buf-2")]
    try:
        for p in procs:  # wait for the split: two partitions each
            await p.wait_assigned(90, n=2)
        expected = await produce_interleaved(cfg, waves=6, groups_per_wave=8, pause_s=0.1)
        audit = await wait_all_decided(cfg, expected, 60, procs)
        records = [r.value for r in await read_topic(cfg.kafka, cfg.names.batches, expect=Batch)]
    finally:
        codes = [p.terminate() for p in procs]
    assert codes == [0, 0]
    assert audit["batched"] == expected and audit["in_two_batches"] == 0, audit
    assert_nothing_lost(audit, prompts="none")
    assert audit["batch_records"] == audit["batches"]  # every batch published exactly once
    assert expected // 8 <= audit["batches"] <= expected // 8 + 4  # full batches of 2 groups, a partial one per partition at most
    assert {r.buffer_id for r in records} == {"buf-1", "buf-2"}
    owners = {}
    for r in records:
        for gid in r.group_ids:
            owners.setdefault(gid, set()).add(r.buffer_id)
    assert all(len(v) == 1 for v in owners.values())
