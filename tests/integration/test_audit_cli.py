"""``streamforge audit`` over real topics and a trainer ledger: the JSON it writes and its exit code (1 for an
episode trained twice, or a prompt lost)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson
import pytest

from buffer.policies import ScoredGroup, batch_id_of, build_batch, group_advantages
from buffer.synthetic import make_group
from helpers.audits import assert_nothing_lost
from streamforge.config import dump_config
from topics.kafka import Consumer, Producer, TopicPartition
from topics.schemas import DropRecord, Prompt

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def scored(episodes) -> ScoredGroup:
    return ScoredGroup(episodes[0].group_id, list(episodes), group_advantages([e.reward for e in episodes]))


def write_ledger(cfg, steps: list[list[str]]) -> None:
    path = cfg.run_dir / "trainer" / "ledger.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps({"step": i + 1, "policy_version": i + 1, "batch_ids": ids, "time": 0.0})
                              + b"\n" for i, ids in enumerate(steps)))


async def run_cli(cfg, tmp_path: Path) -> tuple[int, dict]:
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(cfg))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "streamforge", "audit", "--config", str(path), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode in (0, 1), err.decode()[-2000:]
    written = orjson.loads((cfg.run_dir / "audit.json").read_bytes())
    assert written == orjson.loads(out)
    return proc.returncode, written


async def test_audit_cli_reconciles_and_fails_on_double_training(run_config, tmp_path):
    cfg = run_config
    a, b, c = make_group("a", 4), make_group("b", 4), make_group("c", 4, rewards=[1.0] * 4)
    b1 = build_batch([scored(a)])
    b2 = build_batch([scored(a[:2]), scored(b)])  # a/0 and a/1 again, under another batch id
    assert b1.batch_id == batch_id_of(e.episode_id for e in a) != b2.batch_id
    async with Producer(cfg.kafka) as producer:
        for e in [*a, *b, *c, a[0]]:  # a/0 delivered twice
            await producer.send(cfg.names.episodes, e, key=e.group_id)
        await producer.send_raw(cfg.names.episodes, b"\xc1 not msgpack", key="junk")
        for batch in (b1, b2):
            await producer.send(cfg.names.batches, batch, key=batch.batch_id)
        await producer.send(cfg.names.drops, DropRecord(episode_ids=[e.episode_id for e in c],
                                                        reason="zero_variance", group_id="c"), key="c")
        await producer.send(cfg.names.drops, DropRecord(episode_ids=["a/0"], reason="duplicate", group_id="a"),
                            key="a")

    write_ledger(cfg, [[b1.batch_id]])  # a trainer that trained b1 only
    code, audit = await run_cli(cfg, tmp_path)
    assert code == 0
    assert audit["produced"] == 12 and audit["records"] == 14 and audit["duplicate_records"] == 1
    assert audit["batched"] == 8 and audit["dropped"]["zero_variance"] == 4 and audit["dropped"]["duplicate"] == 1
    assert audit["lost"] == 0 and audit["reconciles"] and audit["in_two_batches"] == 2
    assert audit["trained"] == 4 and audit["trained_twice"] == 0
    assert_nothing_lost(audit, prompts="none")  # episodes fed straight to the topic: no prompt to account for

    write_ledger(cfg, [[b1.batch_id], [b2.batch_id]])  # trained both: a/0 and a/1 twice
    code, audit = await run_cli(cfg, tmp_path)
    assert code == 1 and audit["trained_twice"] == 2 and audit["samples"]["trained_twice"] == ["a/0", "a/1"]


async def test_audit_cli_fails_on_a_prompt_committed_without_an_answer(run_config, tmp_path):
    """Two prompts committed by the generators group, one answered by an Episode naming its place: the other is
    lost, the CLI exits 1 and names it. A third prompt beyond the committed offset is pending, not lost."""
    cfg = run_config
    async with Producer(cfg.kafka) as producer:
        metas = [await producer.send(cfg.names.prompts, Prompt(prompt_id=pid, task="t", text="x"), key="one",
                                     partition=0) for pid in ("answered", "silent", "later")]
        [episode] = make_group("answered", 1)
        episode.prompt_partition, episode.prompt_offset = metas[0].partition, metas[0].offset
        await producer.send(cfg.names.episodes, episode, key=episode.group_id)
    tp = TopicPartition(cfg.names.prompts, 0)
    committer = Consumer(cfg.kafka, [], group_id=cfg.names.generators_group, partitions=[tp])  # commits as a generator
    await committer.start()
    try:
        await committer.commit({tp: metas[1].offset + 1})
    finally:
        await committer.stop()

    code, audit = await run_cli(cfg, tmp_path)
    assert code == 1 and audit["lost"] == 1 and audit["episodes_lost"] == 0 and not audit["reconciles"]
    prompts = audit["prompts"]
    assert prompts["consumed"] == 2 and prompts["answered"] == 1 and prompts["pending"] == 1
    assert prompts["samples"]["lost"] == [{"partition": 0, "offset": metas[1].offset, "prompt_id": "silent"}]


async def test_a_log_without_the_unanswered_topic_is_audited(run_config):
    """A run recorded before the ``unanswered`` topic existed (reopened with ``--run-dir``): no reasons, no error."""
    from aiokafka.admin import AIOKafkaAdminClient

    from streamforge.audit import run_audit
    from topics.kafka import client_kwargs

    cfg = run_config
    admin = AIOKafkaAdminClient(**client_kwargs(cfg.kafka, client_id="test-admin"))
    await admin.start()
    try:
        await admin.delete_topics([cfg.names.unanswered])
    finally:
        await admin.close()
    async with Producer(cfg.kafka) as producer:
        await producer.send(cfg.names.prompts, Prompt(prompt_id="only", task="t", text="x"), key="only")
    audit = await run_audit(cfg)
    assert audit["prompts"]["records"] == 1 and audit["prompts"]["pending"] == 1  # nothing committed: pending
    assert audit["prompts"]["unanswered_by_reason"] == {} and audit["lost"] == 0 and audit["reconciles"]
