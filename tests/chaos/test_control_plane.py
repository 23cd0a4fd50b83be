"""The NATS control plane under faulty and hostile input, through a running ``streamforge up`` (demo config):
no crash, no hang, no false success.

* garbage written over the policy store's ``latest`` once mid-run: training goes on to ``max_steps``, the bad value
  is dead-lettered with the source ``kv:<bucket>/latest``;
* 100 joins from generators that do not exist: no gap between steps above the handshake timeout;
* joins with 30,000-character ids: refused, and the fencing record is still written;
* acks for versions never published, in a real generator's name: refused, and the real acks still counted;
* a trainer whose training loop fails: its process exits within ``CRASH_EXIT_S`` and ``up`` restarts it, or, without
  ``up.restart``, exits non-zero;
* a wall budget that runs out: ``up`` exits non-zero and says so.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from helpers.audits import assert_nothing_lost
from runtime.lifecycle import CRASH_EXIT_S
from streamforge.plots import read_metrics
from topics.config import KafkaConfig, NatsConfig
from topics.names import Names
from topics.nats import PolicyStore, connect, publish_msg
from topics.schemas import DeadLetter, Membership, VersionAck
from weightsync.members import parse_fenced

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
HANDSHAKE_S = 8.0


class Up:
    """``streamforge up`` in the background; its stdout collected by a thread (it prints the broker addresses)."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
        env.update(VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT / "tests"))
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamforge", "up", "--config", "configs/demo.yaml", "--run-dir", str(run_dir),
             "--up.lag_every_s=0", *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def address(self, key: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = re.search(rf"^{key}=(\S+)$", self.out, re.MULTILINE)
            if m:
                return m.group(1)
            assert self.proc.poll() is None, self.out[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"up printed no {key}")

    def steps(self) -> int:
        return len(read_metrics(self.run_dir / "metrics.jsonl"))

    async def until_step(self, n: int, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while self.steps() < n:
            assert self.proc.poll() is None, self.out[-3000:]
            assert time.monotonic() < deadline, f"step {n} not reached"
            await asyncio.sleep(0.3)

    def wait(self, timeout_s: float = 600) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, 9)
            self._reader.join(5)


async def dead_letters(kafka: str, names: Names) -> list[DeadLetter]:
    from topics.admin import read_topic

    return [r.value for r in await read_topic(KafkaConfig(bootstrap=kafka), names.dead_letter, expect=DeadLetter)
            if r.value is not None]


@pytest.mark.timeout(900)
async def test_hostile_control_plane_input_does_not_stop_or_stall_training(tmp_path: Path) -> None:
    steps = 300  # the run must outlast every phase below on a fast machine (110 steps were over in 12 s)
    up = Up(tmp_path / "run", f"--trainer.max_steps={steps}", "--trainer.reward_target=0",
            f"--weightsync.handshake_timeout_s={HANDSHAKE_S}", "--up.max_wall_s=700")
    nats_url, kafka = up.address("NATS_URL"), up.address("KAFKA_BOOTSTRAP")
    names = Names("demo")
    nc = await connect(NatsConfig(url=nats_url), name="adversary")
    store = PolicyStore(nc, names)
    try:
        await up.until_step(15)
        await store.start()
        await store.put(names.LATEST_KEY, b"\x93not a policy version")  # garbage over the trainer's key, once
        await up.until_step(30)
        for i in range(100):  # generators that do not exist: they never complete the handshake
            join = Membership(generator_id=f"fuzz-{i}", event="join", host="nowhere", pid=i)
            try:
                await nc.request(names.membership_subject, _encode(join), timeout=0.05)
            except Exception:  # noqa: BLE001, S110 - nobody needs to answer a fake
                pass
        await up.until_step(45)
        _, fenced_rev = await store.entry("fenced")
        for i in range(5):  # ids far beyond any bound
            await publish_msg(nc, names.membership_subject, Membership(generator_id="x" * 30_000 + str(i),
                                                                       event="join"))
        # a valid id that never completes a handshake: dropped from its round and fenced, so the record is
        # written again after the oversized ids
        await publish_msg(nc, names.membership_subject, Membership(generator_id="late-fake", event="join"))
        await up.until_step(60)
        for _ in range(100):
            fenced_now = parse_fenced(await store.get("fenced"))
            if "late-fake" in fenced_now:
                break
            await asyncio.sleep(0.2)
        for v in range(888_888, 888_898):  # acks for versions never published, in the real generator's name
            await publish_msg(nc, names.ack_subject, VersionAck(generator_id="generator-0", version=v))
        await nc.flush()
        _, rev_after = await store.entry("fenced")
        # the dead letters are read while the run goes on (up's embedded broker ends with the run)
        deadline = time.monotonic() + 60
        while True:
            letters = await dead_letters(kafka, names)
            forged = [d for d in letters if d.source == names.ack_subject and "never published" in d.detail]
            if len(forged) >= 10 or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
    finally:
        await nc.close()
    code = up.wait()
    assert code == 0, up.out[-4000:]
    rows = read_metrics(up.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    gaps = [b["time_s"] - a["time_s"] for a, b in itertools.pairwise(rows)]
    assert max(gaps) < HANDSHAKE_S, max(gaps)  # fake joiners never held a round for its ack deadline
    assert rev_after > fenced_rev  # the fencing record was written after the oversized ids came
    assert "late-fake" in fenced_now and all(len(gid) <= 128 for gid in fenced_now), fenced_now
    assert any(d.source == f"kv:{names.policy_bucket}/latest" for d in letters)
    long_ids = [d for d in letters if d.source == names.membership_subject and "30001 characters" in d.detail]
    assert len(long_ids) >= 5 and all(d.reason == "invalid" for d in long_ids)
    assert len(forged) == 10
    provenance = [orjson.loads(line) for line in (up.run_dir / "weightsync" / "versions.jsonl").read_bytes()
                  .splitlines()]
    late = [p for p in provenance if p["step"] > 65]
    assert late and sum("generator-0" in p["acks"] for p in late) >= len(late) // 2  # real acks still counted
    audit = orjson.loads((up.run_dir / "audit.json").read_bytes())
    assert_nothing_lost(audit, reconciles=False)


def _encode(msg) -> bytes:
    from topics import codec

    return codec.encode(msg)


@pytest.mark.timeout(900)
def test_a_failed_trainer_loop_exits_at_once_and_up_restarts_it(tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    up = Up(tmp_path / "run", "--trainer.max_steps=40", "--trainer.reward_target=0", "--trainer.checkpoint_every=10",
            "--up.restart=true", "--trainer.loss=helpers.losses:fail_once_at",
            f'--trainer.loss_args={{"calls": 15, "marker": "{marker}"}}', "--up.max_wall_s=700")
    code = up.wait(840)
    assert code == 0, up.out[-4000:]
    assert marker.exists() and "trainer exited with code 1; restarting it" in up.out
    log = (up.run_dir / "logs" / "trainer.log").read_text()
    crashed = re.search(r"^(\S+ \S+) ERROR streamforge.lifecycle: role 'trainer': loop 'train' stopped unexpectedly",
                        log, re.MULTILINE)
    restarted = re.search(r"^(\S+ \S+) INFO streamforge.trainer: trainer resumed from step", log, re.MULTILINE)
    assert crashed and restarted, log[-3000:]
    assert [r["step"] for r in read_metrics(up.run_dir / "metrics.jsonl")][-1] == 40
    assert "injected failure at loss call 15" in log


@pytest.mark.timeout(600)
def test_a_failed_trainer_loop_without_restart_fails_the_run(tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    t0 = time.monotonic()
    up = Up(tmp_path / "run", "--trainer.max_steps=40", "--trainer.reward_target=0",
            "--trainer.loss=helpers.losses:fail_once_at", f'--trainer.loss_args={{"calls": 3, "marker": "{marker}"}}',
            "--up.max_wall_s=500")
    code = up.wait(540)
    assert code == 1, up.out[-3000:]
    assert "trainer exited with code 1" in up.out and "injected failure" in up.out
    assert "trainer finished" not in up.out
    log = (up.run_dir / "logs" / "trainer.log").read_text()
    assert "stopped unexpectedly" in log
    assert not (up.run_dir / "trainer" / "done.json").exists()
    assert time.monotonic() - t0 < 500
    assert CRASH_EXIT_S <= 10  # the bound up relies on


@pytest.mark.timeout(300)
def test_a_spent_wall_budget_is_a_failure(tmp_path: Path) -> None:
    """No generator: the trainer never gets a batch, and the budget runs out."""
    up = Up(tmp_path / "run", "--up.generators=0", "--model.warmstart_task=", "--up.max_wall_s=8")
    code = up.wait(240)
    assert code == 1, up.out[-3000:]
    assert "wall-clock budget of 8 s reached before the trainer finished" in up.out
