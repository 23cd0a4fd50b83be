"""A finished run reopened: `streamforge replay`, `provenance` and `audit --run-dir` on one short real `up` run.

The run (the demo config, a few steps) ends and stops its brokers; its log stays in the run directory (the archive
in ``log/``, NATS's JetStream store in ``brokers/``). The first test replays it through the CLI, which starts the
embedded brokers again and restores the archive into them; the others share one reopened broker (``reopened``). Everything is checked against the run's own
records: the ledger, metrics.jsonl, versions.jsonl and the topics read whole.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from helpers.audits import assert_nothing_lost
from streamforge.brokers import serving
from streamforge.provenance import episode_provenance, version_provenance
from streamforge.replay import BatchesGone, replay
from streamforge.runlog import broker_dir, reopen, run_config
from topics.admin import ensure_topics, read_topic, topic_configs
from topics.kafka import Producer
from topics.schemas import Batch, DropRecord, Episode

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamforge", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short demo run, finished: its brokers stopped, its log left in ``<run_dir>/brokers``."""
    run_dir = tmp_path_factory.mktemp("replay") / "run"
    proc = _cli("up", "--config", "configs/demo.yaml", "--run-dir", str(run_dir), f"--trainer.max_steps={STEPS}",
                "--trainer.reward_target=0", "--trainer.checkpoint_every=5", "--up.max_wall_s=400",
                "--up.live=lines", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(_jsonl(run_dir / "trainer" / "ledger.jsonl")) == STEPS
    return run_dir


@pytest.fixture(scope="module")
async def reopened(run_dir: Path):
    """The run's config pointed at its log, reopened once for the tests that share it."""
    async with reopen(run_config(run_dir)) as config:
        yield config


@pytest.mark.timeout(900)
def test_replay_restarts_the_stopped_broker_and_trains_the_same_losses(run_dir: Path) -> None:
    assert serving(broker_dir(run_config(run_dir))) is None  # the run's brokers stopped with `up`
    proc = _cli("replay", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = orjson.loads(proc.stdout.strip().splitlines()[-1])
    assert result["replay"] == str(run_dir) and result["steps"] == STEPS, result
    assert result["identical"] is True and result["max_loss_diff"] <= 1e-6, result
    assert result["max_grad_norm_diff"] <= 1e-6 * max(1.0, max(r["grad_norm"] for r in _jsonl(run_dir / "metrics.jsonl")))
    rows = _jsonl(run_dir / "replay" / "metrics.jsonl")
    ledger = _jsonl(run_dir / "trainer" / "ledger.jsonl")
    assert [r["batch_id"] for r in rows] == [line["batch_ids"][0] for line in ledger]
    assert all(abs(r["loss"] - r["orig_loss"]) <= 1e-6 for r in rows)
    assert serving(broker_dir(run_config(run_dir))) is None  # the replay stopped the broker it started


@pytest.mark.timeout(300)
async def test_replay_under_another_loss_trains_the_same_batches(reopened, tmp_path: Path) -> None:
    result = await replay(reopened, steps=4, out=tmp_path / "dr", loss="dr_grpo")
    assert result["steps"] == 4 and result["loss"] == "dr_grpo"
    rows = _jsonl(tmp_path / "dr" / "metrics.jsonl")
    ledger = _jsonl(reopened.run_dir / "trainer" / "ledger.jsonl")
    assert [r["batch_id"] for r in rows] == [line["batch_ids"][0] for line in ledger[:4]]
    assert all(np.isfinite(r["loss"]) and r["orig_loss"] is not None for r in rows)
    assert result["max_loss_diff"] > 0  # dr_grpo normalises by the completion length: not the run's grpo loss


@pytest.mark.timeout(300)
async def test_a_replay_whose_batches_are_gone_names_them_and_trains_nothing(reopened, tmp_path: Path) -> None:
    """The batches topic loses two trained batches (deleted and recreated without them, as retention or a
    delete-records would leave it): the replay names both with their steps and stops before training."""
    from aiokafka.admin import AIOKafkaAdminClient

    config = reopened
    topic = config.names.batches
    records = await read_topic(config.kafka, topic, expect=Batch)
    ledger = _jsonl(config.run_dir / "trainer" / "ledger.jsonl")
    gone = {ledger[2]["batch_ids"][0]: 3, ledger[7]["batch_ids"][0]: 8}
    admin = AIOKafkaAdminClient(bootstrap_servers=config.kafka.bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()
    await ensure_topics(config.kafka, config.names, config.topics)
    async with Producer(config.kafka) as producer:
        for r in records:
            if r.value.batch_id not in gone:
                await producer.send(topic, r.value, key=r.value.batch_id)
    try:
        with pytest.raises(BatchesGone) as err:
            await replay(config, out=tmp_path / "gone")
        assert sorted(err.value.missing) == sorted((step, bid) for bid, step in gone.items())
        assert all(bid in str(err.value) for bid in gone)
        assert not (tmp_path / "gone" / "metrics.jsonl").exists()  # stopped before the first step
    finally:  # the other tests read the topic: put the two back (replay finds batches by id, not offset)
        async with Producer(config.kafka) as producer:
            for r in records:
                if r.value.batch_id in gone:
                    await producer.send(topic, r.value, key=r.value.batch_id)


@pytest.mark.timeout(300)
async def test_provenance_of_a_version_matches_the_ledger_and_the_topics(reopened) -> None:
    config = reopened
    versions = _jsonl(config.run_dir / "weightsync" / "versions.jsonl")
    line = next(v for v in versions if v["acks"] and v["batch_ids"])
    ledger = _jsonl(config.run_dir / "trainer" / "ledger.jsonl")
    out = await version_provenance(config, line["version"])
    assert out["version"] == line["version"] and out["batch_ids"] == line["batch_ids"]
    assert out["steps"] == sorted(r["step"] for r in ledger if r["batch_ids"][0] in line["batch_ids"])
    assert out["steps"] == sorted(r["step"] for r in ledger if r["policy_version"] == line["version"] - 1)
    trained = {e for r in ledger if r["step"] in out["steps"] for e in r["episode_ids"]}
    assert {e["episode_id"] for e in out["episodes"]} == trained
    on_topic = {(r.partition, r.offset): r.value for r in await read_topic(config.kafka, config.names.episodes,
                                                                           expect=Episode)}
    for e in out["episodes"]:  # every (partition, offset) holds that episode, from the prompt named
        record = on_topic[(e["partition"], e["offset"])]
        assert record.episode_id == e["episode_id"] and record.prompt_id == e["prompt_id"]
    assert out["prompts"] and all(p["text"] for p in out["prompts"])
    assert [a["generator_id"] for a in out["adopted_by"]] == [g for g, a in line["acks"].items() if a["ok"]]
    assert all(a["at"] for a in out["adopted_by"]) and out["fenced"] == line["fenced"]
    proc = _cli("provenance", "--run-dir", str(config.run_dir), str(line["version"]), "--json")  # the served log
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = orjson.loads(proc.stdout.strip().splitlines()[-1])
    assert {"version", "steps", "batch_ids", "episodes", "adopted_by", "fenced"} <= set(last)
    assert last["episodes"] == out["episodes"] and last["steps"] == out["steps"]


@pytest.mark.timeout(300)
async def test_provenance_of_an_episode_names_its_step_or_its_drop(reopened) -> None:
    config = reopened
    ledger = _jsonl(config.run_dir / "trainer" / "ledger.jsonl")
    row = ledger[4]
    out = await episode_provenance(config, row["episode_ids"][3])
    assert (out["step"], out["batch_id"]) == (row["step"], row["batch_ids"][0])
    assert out["trained"][0]["trained_with_version"] == row["policy_version"]
    forward = await version_provenance(config, out["version"])  # the reverse agrees with the forward
    assert row["step"] in forward["steps"]
    assert {"episode_id": out["episode_id"], "partition": out["partition"], "offset": out["offset"],
            "prompt_id": out["prompt_id"]} in forward["episodes"]
    drops = [r.value for r in await read_topic(config.kafka, config.names.drops, expect=DropRecord)
             if r.value.reason != "duplicate"]
    assert drops, "the demo drops zero-variance groups"
    dropped = await episode_provenance(config, drops[0].episode_ids[0])
    assert dropped["trained"] == [] and dropped["dropped"] == drops[0].reason and dropped["offset"] is not None
    nothing = await episode_provenance(config, "no-such-group/0")
    assert not nothing["found"] and nothing["dropped"] is None


@pytest.mark.timeout(300)
async def test_audit_and_nats_reopen_and_the_demo_keeps_its_topics(reopened) -> None:
    config = reopened
    for suffix in ("prompts", "episodes", "batches", "drops", "unanswered", "dead-letter"):  # demo.yaml keeps all
        assert (await topic_configs(config.kafka, f"{config.names.prefix}.{suffix}"))["retention.ms"] == "-1"
    proc = _cli("audit", "--run-dir", str(config.run_dir))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    audit = orjson.loads((config.run_dir / "audit.json").read_bytes())
    assert_nothing_lost(audit)  # also from the log reopened: the prompts topic and the generators' offsets came back
    assert audit["trained"] == sum(len(r["episode_ids"]) for r in
                                                           _jsonl(config.run_dir / "trainer" / "ledger.jsonl"))
    from topics.nats import PolicyStore, connect

    nc = await connect(config.nats, name="test")  # the JetStream state came back too: the policy bucket
    try:
        store = PolicyStore(nc, config.names)
        await store.start()
        latest, _ = await store.latest()
    finally:
        await nc.close()
    assert latest.version == _jsonl(config.run_dir / "weightsync" / "versions.jsonl")[-1]["version"]
