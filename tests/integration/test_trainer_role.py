"""The trainer role against real brokers: batches in, versions out; SIGKILL and restart train each batch once.

Batches here are synthetic but well-formed (random tokens of the tiny model's vocabulary, a GRPO-shaped mask,
behaviour logprobs, advantages), produced to the run's ``batches`` topic with the real Kafka producer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from consumers.ledger import Ledger
from helpers.configs import unbounded
from topics.admin import read_topic
from topics.kafka import Producer
from topics.nats import PolicyStore, connect
from topics.schemas import Batch, DeadLetter, SFTExample

ROOT = Path(__file__).resolve().parents[2]


def make_batch(i: int, *, b: int = 4, t: int = 12, version: int = 0) -> Batch:
    rng = np.random.default_rng(i)
    ids = rng.integers(4, 64, size=(b, t)).astype(np.int32)
    mask = np.zeros((b, t), dtype=np.uint8)
    mask[:, 5:] = 1
    old = np.where(mask == 1, -rng.random((b, t)) * 4, 0).astype(np.float32)
    versions = np.where(mask == 1, version, -1).astype(np.int32)
    rewards = rng.integers(0, 2, size=b).astype(np.float32)
    return Batch(batch_id=f"batch-{i:03d}", episode_ids=[f"g{i}/{j}" for j in range(b)], group_ids=[f"g{i}"] * b,
                 input_ids=ids, loss_mask=mask, old_logprobs=old, token_versions=versions,
                 advantages=(rewards - rewards.mean()).astype(np.float32), rewards=rewards,
                 prompt_lens=np.full(b, 5, dtype=np.int32), seq_lens=np.full(b, t, dtype=np.int32))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


async def produce(cfg, topic: str, msgs: list, *, raw: list[bytes] = ()) -> None:
    async with Producer(cfg.kafka) as producer:
        for m in msgs:
            await producer.send(topic, m, key=getattr(m, "batch_id", None) or getattr(m, "example_id", None))
        for r in raw:
            await producer.send_raw(topic, r)


async def latest_version(cfg):
    nc = await connect(cfg.nats, name="test")
    try:
        store = PolicyStore(nc, cfg.names)
        await store.start()
        return (await store.latest())[0]
    finally:
        await nc.close()


async def trainer_progress(cfg):
    nc = await connect(cfg.nats, name="test")
    try:
        store = PolicyStore(nc, cfg.names)
        await store.start()
        return await store.progress()
    finally:
        await nc.close()


@pytest.mark.timeout(180)
async def test_batches_in_versions_out(run_config, tiny_dir: Path):
    from streamforge.roles import build_role

    cfg = unbounded(run_config)  # batches made beforehand: no staleness bound
    cfg.model.path = str(tiny_dir)
    cfg.trainer.max_steps = 3
    cfg.trainer.checkpoint_every = 2
    cfg.trainer.lr = 1e-3
    cfg.trainer.loss_args = {"beta": 0.04}  # the KL term; its reference is the initial model (trainer.ref_model "")
    cfg.weightsync.transport = "file"
    cfg.weightsync.ack_deadline_s = 2.0
    batches = [make_batch(i) for i in range(3)]
    # two buffers stamp their cumulative drop counters on their batches; the trainer's rows sum the latest of each
    batches[0].buffer_id, batches[0].stats = "buffer-a", {"dropped/stale": 3.0, "reward_mean": 0.5}
    batches[1].buffer_id, batches[1].stats = "buffer-b", {"dropped/stale": 1.0, "dropped/overlong": 2.0}
    batches[2].buffer_id, batches[2].stats = "buffer-a", {"dropped/stale": 5.0}
    # a redelivered batch and a malformed record between the good ones
    await produce(cfg, cfg.names.batches, [batches[0], batches[0], batches[1]], raw=[b"\x93not a batch"])
    too_long = make_batch(98, t=cfg.model.max_seq_len + 1)
    await produce(cfg, cfg.names.batches, [too_long, batches[2], make_batch(99)])

    role = build_role("trainer", cfg)
    await asyncio.wait_for(role.serve(), 150)
    assert role.finished_reason.startswith("max_steps")

    ledger = Ledger.read(cfg.run_dir)
    assert [r["step"] for r in ledger] == [1, 2, 3]
    assert [r["batch_ids"] for r in ledger] == [["batch-000"], ["batch-001"], ["batch-002"]]
    assert [r["policy_version"] for r in ledger] == [0, 1, 2]

    pv = await latest_version(cfg)
    assert pv is not None and pv.version == 3 and pv.step == 3 and pv.transport == "file"
    assert pv.batch_ids == ["batch-002"]
    assert Path(pv.path).exists()
    progress = await trainer_progress(cfg)  # a group a batch: the generators' quota counts them
    assert progress is not None and progress.step == 3 and progress.groups == 3

    import orjson
    rows = [orjson.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("step", "policy_version", "time_s", "reward_mean", "loss", "staleness_mean", "episodes",
                    "kl", "entropy", "clip_fraction", "grad_norm", "tokens_per_s", "lr"):
            assert key in r, key
        assert r["episodes"] == 4 and np.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1 trains the reference's own weights
    assert rows[1]["kl"] > 1e-6 and rows[2]["kl"] > 1e-6  # the updates moved the policy away from it
    assert rows[-1]["staleness_mean"] == 2.0  # tokens sampled by version 0, trained at version 2
    assert rows[-1]["duplicates"] == 1
    drops = [{k: v for k, v in r.items() if k.startswith("buffer/dropped/")} for r in rows]
    assert drops == [{"buffer/dropped/stale": 3.0},
                     {"buffer/dropped/stale": 4.0, "buffer/dropped/overlong": 2.0},
                     {"buffer/dropped/stale": 6.0, "buffer/dropped/overlong": 2.0}]

    ckpts = sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-2", "step-3"]
    assert (cfg.run_dir / "hf" / "model.safetensors").exists()
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(cfg.run_dir / "hf")

    letters = await read_topic(cfg.kafka, cfg.names.dead_letter, expect=DeadLetter)
    assert [x.value.reason for x in letters] == ["malformed", "invalid"]  # garbage, then the too-long batch
    assert all(x.value.source == cfg.names.batches for x in letters) and "max_seq_len" in letters[1].value.detail


@pytest.mark.timeout(180)
async def test_a_batch_too_stale_when_its_turn_comes_is_dropped_and_counted(run_config, tiny_dir: Path):
    """staleness.max_versions (2 here) holds where it matters, when the trainer reaches a batch: after three
    versions, batches sampled at version 0 are refused (dead-lettered as ``stale``, counted), a fresh one trains."""
    import dataclasses

    from streamforge.roles import build_role
    from streamforge.staleness import StalenessConfig

    cfg = dataclasses.replace(run_config, staleness=StalenessConfig(max_versions=2))
    cfg.model.path = str(tiny_dir)
    cfg.trainer.max_steps = 4
    cfg.trainer.checkpoint_every = 100
    cfg.weightsync.transport = "file"
    cfg.weightsync.ack_deadline_s = 2.0
    old = [make_batch(i) for i in range(5)]  # all sampled by version 0
    await produce(cfg, cfg.names.batches, [*old, make_batch(5, version=3)])
    role = build_role("trainer", cfg)
    await asyncio.wait_for(role.serve(), 150)
    assert role.finished_reason.startswith("max_steps")
    ledger = Ledger.read(cfg.run_dir)
    # trained at versions 0, 1, 2 (staleness <= 2); at version 3 batches 3 and 4 are 3 versions behind
    assert [r["batch_ids"][0] for r in ledger] == ["batch-000", "batch-001", "batch-002", "batch-005"]
    import orjson

    rows = [orjson.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert max(r["staleness_max"] for r in rows) <= 2 and rows[-1]["stale_batches"] == 2
    letters = await read_topic(cfg.kafka, cfg.names.dead_letter, expect=DeadLetter)
    assert [x.value.reason for x in letters] == ["stale", "stale"]
    assert all("staleness.max_versions 2" in x.value.detail for x in letters)
    from streamforge.audit import run_audit

    audit = await run_audit(cfg)
    assert audit["stale_batches"] == 2 and audit["stale_batch_episodes"] == 8


@pytest.mark.timeout(180)
async def test_sft_mode_learns_completions(run_config, tiny_dir: Path):
    from streamforge.roles import build_role

    cfg = unbounded(run_config)  # batches made beforehand: no staleness bound
    cfg.model.path = str(tiny_dir)
    cfg.trainer.mode = "sft"
    cfg.trainer.max_steps = 12
    cfg.trainer.sft_batch_size = 4
    cfg.trainer.lr = 3e-3
    cfg.trainer.checkpoint_every = 100
    cfg.nats.url = ""  # SFT without generators: nothing to publish
    examples = [SFTExample(example_id=f"ex{i}", prompt=f"{i % 4}+1=", completion=str(i % 4 + 1))
                for i in range(48)]
    await produce(cfg, cfg.names.sft, examples)
    role = build_role("trainer", cfg)
    await asyncio.wait_for(role.serve(), 150)
    import orjson
    rows = [orjson.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert len(rows) == 12 and all(r["episodes"] == 4 for r in rows)
    assert np.mean([r["loss"] for r in rows[-3:]]) < 0.5 * np.mean([r["loss"] for r in rows[:3]])
    ids = [b for r in Ledger.read(cfg.run_dir) for b in r["batch_ids"]]
    assert len(ids) == len(set(ids)) == 12


def _trainer_cmd(cfg, tiny_dir: Path, max_steps: int) -> list[str]:
    return [sys.executable, "-m", "streamforge", "run", "trainer",
            f"--run.prefix={cfg.run.prefix}", f"--run.run_dir={cfg.run_dir}",
            f"--kafka.bootstrap={cfg.kafka.bootstrap}", f"--nats.url={cfg.nats.url}",
            f"--model.path={tiny_dir}", f"--trainer.max_steps={max_steps}", "--trainer.checkpoint_every=4",
            "--trainer.poll_timeout_ms=200", "--weightsync.transport=file", "--weightsync.ack_deadline_s=1",
            "--telemetry.traces=none", "--telemetry.metrics=[]", "--staleness.max_versions=-1"]


async def _wait_for(pred, timeout: float, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


@pytest.mark.timeout(300)
async def test_sigkill_after_checkpoint_restart_trains_each_batch_once(run_config, tiny_dir: Path):
    cfg = unbounded(run_config)  # batches made beforehand: no staleness bound
    total = 12
    batches = [make_batch(i) for i in range(total)]
    await produce(cfg, cfg.names.batches, batches[:7])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log1 = open(cfg.run_dir.parent / "trainer1.log", "wb")  # noqa: SIM115, ASYNC230
    proc = subprocess.Popen(_trainer_cmd(cfg, tiny_dir, total), env=env, stdout=log1, stderr=subprocess.STDOUT)
    try:
        # 7 batches available: the trainer checkpoints at step 4 and goes on to step 7, then waits for more
        await _wait_for(lambda: len(Ledger.read(cfg.run_dir)) >= 7, 120, proc, "7 trained steps")
        assert (cfg.run_dir / "checkpoints" / "step-4" / "meta.json").exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        log1.close()
    before = [b for r in Ledger.read(cfg.run_dir) for b in r["batch_ids"]]
    assert before == [f"batch-{i:03d}" for i in range(7)]

    await produce(cfg, cfg.names.batches, [batches[3], *batches[7:]])  # plus a redelivery of batch 3
    log2 = open(cfg.run_dir.parent / "trainer2.log", "wb")  # noqa: SIM115, ASYNC230
    proc = subprocess.Popen(_trainer_cmd(cfg, tiny_dir, total), env=env, stdout=log2, stderr=subprocess.STDOUT)
    try:
        rc = await asyncio.wait_for(asyncio.to_thread(proc.wait), 150)
    finally:
        if proc.poll() is None:
            proc.kill()
        log2.close()
    assert rc == 0, (cfg.run_dir.parent / "trainer2.log").read_text()[-3000:]
    ledger = Ledger.read(cfg.run_dir)
    ids = [b for r in ledger for b in r["batch_ids"]]
    assert ids == [f"batch-{i:03d}" for i in range(total)]  # none repeated, none skipped, in order
    assert [r["step"] for r in ledger] == list(range(1, total + 1))
    pv = await latest_version(cfg)
    # versions 5..6 (7 if its round reached the store before the kill) were published before the crash; the
    # restart continues after the store's latest, so versions never go backwards: 8 more from there
    assert pv is not None and pv.step == total and pv.version in (6 + total - 4, 7 + total - 4)
    assert "resumed from step 4" in (cfg.run_dir.parent / "trainer2.log").read_text()
    # the groups trained come back with the checkpoint of step 4, and the 8 steps after it add theirs
    assert json.loads((cfg.run_dir / "checkpoints" / f"step-{total}" / "meta.json").read_text())["groups"] == total
    progress = await trainer_progress(cfg)
    assert progress is not None and progress.step == total and progress.groups == total


@pytest.mark.timeout(180)
async def test_reward_target_stops_and_graceful_stop_checkpoints(run_config, tiny_dir: Path):
    from streamforge.roles import build_role

    cfg = unbounded(run_config)  # batches made beforehand: no staleness bound
    cfg.model.path = str(tiny_dir)
    cfg.trainer.reward_target = 0.9
    cfg.trainer.reward_window = 2
    cfg.trainer.checkpoint_every = 100
    cfg.trainer.poll_timeout_ms = 200
    cfg.weightsync.transport = "file"
    cfg.weightsync.ack_deadline_s = 1.0
    good = [make_batch(i) for i in range(3)]
    for b in good:
        b.rewards[:] = 1.0
    await produce(cfg, cfg.names.batches, [make_batch(50), *good])
    role = build_role("trainer", cfg)
    await asyncio.wait_for(role.serve(), 150)
    assert role.finished_reason.startswith("mean reward")
    assert len(Ledger.read(cfg.run_dir)) == 3  # batch 50 (mixed rewards), then two at 1.0
    assert (cfg.run_dir / "checkpoints" / "step-3").exists()  # the end of a run is always checkpointed

    # A graceful stop (SIGTERM in a process) while waiting for batches: checkpoint, export, release.
    cfg.trainer.reward_target = 0.0
    role = build_role("trainer", cfg)
    stop = asyncio.Event()
    task = asyncio.ensure_future(role.serve(stop))
    await produce(cfg, cfg.names.batches, [make_batch(60)])
    deadline = time.monotonic() + 90
    while len(Ledger.read(cfg.run_dir)) < 5:  # batch-002 (left when the target was met), then batch-060
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(task, 60)
    assert [r["batch_ids"][0] for r in Ledger.read(cfg.run_dir)][-2:] == ["batch-002", "batch-060"]
    assert (cfg.run_dir / "checkpoints" / "step-5").exists() and (cfg.run_dir / "hf" / "config.json").exists()
