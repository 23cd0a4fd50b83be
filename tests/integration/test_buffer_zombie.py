"""A zombie buffer's batch is never trained: the trainer refuses a batch holding an episode it already trained.

A zombie is a buffer whose consumer-group session expired while it still runs: the partition's new owner replays
and batches the same episodes, and the zombie may still publish its own batch of some of them, with another
batch_id (Kafka without transactions cannot fence that publish). Here a real buffer role batches real episodes on
real brokers; the zombie's batch is what such a buffer publishes (a group of an already-batched partition, cut
into a batch of its own), sent to the real ``batches`` topic; the real trainer (torchtitan tiny model) must
refuse it, dead-letter it as ``already_trained``, keep refusing after a restart (its memory is rebuilt from the
ledger), and the audit must count it: in two batches, trained once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from buffer.policies import build_batch, score_group
from buffer.synthetic import make_group
from consumers.ledger import ALREADY_TRAINED, Ledger
from helpers.audits import assert_nothing_lost
from helpers.configs import unbounded
from streamforge.audit import run_audit
from streamforge.roles import build_role
from topics.admin import read_topic
from topics.kafka import Producer
from topics.schemas import Batch, DeadLetter

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


async def wait_batched(role, n: int, task: asyncio.Task) -> None:
    for _ in range(600):
        if task.done():
            task.result()
        if role.state.counters["batched_episodes"] >= n:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"buffer batched {role.state.counters['batched_episodes']} of {n} episodes")


async def batches_on_topic(cfg) -> list[Batch]:
    return [r.value for r in await read_topic(cfg.kafka, cfg.names.batches, expect=Batch)]


async def train(cfg, max_steps: int):
    from streamforge.roles import build_role

    cfg.trainer.max_steps = max_steps
    role = build_role("trainer", cfg)
    await asyncio.wait_for(role.serve(), 150)
    assert role.finished_reason.startswith("max_steps"), role.finished_reason
    return role


async def test_trainer_refuses_a_zombie_buffers_batch_and_the_audit_counts_it(run_config, tiny_dir: Path):
    # the buffer batches a backlog before the trainer runs: no staleness bound
    cfg = unbounded(run_config, groups_per_batch=2, max_batch_wait_s=0.3, buffer_id="live", max_policy_lag=1000)
    cfg.model.path = str(tiny_dir)
    cfg.trainer.checkpoint_every = 100
    cfg.trainer.lr = 1e-3
    cfg.weightsync.transport = "file"
    cfg.weightsync.ack_deadline_s = 2.0
    episodes = {g: make_group(g, 4, rewards=[0.0, 1.0, 0.0, 2.0]) for g in [f"g{i}" for i in range(12)]}

    async def produce(groups: list[str]) -> None:
        async with Producer(cfg.kafka) as producer:
            for g in groups:
                for e in episodes[g]:
                    await producer.send(cfg.names.episodes, e, key=g)

    async def publish_zombie(of: Batch) -> Batch:
        """The zombie's batch: the first group of a (two-group) batch the live owner published, in a batch of its
        own."""
        gid = of.group_ids[0]
        kept = score_group(gid, episodes[gid], latest_version=None, max_policy_lag=2).kept
        zombie = build_batch([kept], buffer_id="zombie")
        assert zombie.batch_id != of.batch_id and set(zombie.episode_ids) < set(of.episode_ids)
        async with Producer(cfg.kafka) as producer:
            await producer.send(cfg.names.batches, zombie, key=zombie.batch_id)
        return zombie

    buffer = build_role("buffer", cfg)
    stop = asyncio.Event()
    task = asyncio.ensure_future(buffer.serve(stop))
    try:
        await produce([f"g{i}" for i in range(6)])
        await wait_batched(buffer, 24, task)
        first = await batches_on_topic(cfg)
        zombie1 = await publish_zombie(next(b for b in first if len(set(b.group_ids)) > 1))  # after every live batch of g0..g5: read by the trainer later
        await produce(["g6", "g7"])
        await wait_batched(buffer, 32, task)
        live = [b for b in await batches_on_topic(cfg) if b.buffer_id == "live"]

        role = await train(cfg, len(live))  # trains the live batches, refuses the zombie's between them
        assert role.refused == 1
        ledger = Ledger.read(cfg.run_dir)
        assert [r["batch_ids"][0] for r in ledger] == [b.batch_id for b in live]
        assert ledger[0]["episode_ids"] == live[0].episode_ids

        # after a restart the trainer still knows what it trained (rebuilt from the ledger at its checkpoint)
        zombie2 = await publish_zombie(next(b for b in reversed(live) if len(set(b.group_ids)) > 1))
        await produce(["g8", "g9"])
        await wait_batched(buffer, 40, task)
        live = [b for b in await batches_on_topic(cfg) if b.buffer_id == "live"]
        role = await train(cfg, len(live))
        assert role.refused == 1 and len(Ledger.read(cfg.run_dir)) == len(live)
    finally:
        stop.set()
        await task

    letters = [r.value for r in await read_topic(cfg.kafka, cfg.names.dead_letter, expect=DeadLetter)]
    refused = [x for x in letters if x.reason == ALREADY_TRAINED]
    assert [x.source for x in refused] == [cfg.names.batches] * 2
    assert zombie1.batch_id in refused[0].detail and zombie2.batch_id in refused[1].detail

    audit = await run_audit(cfg)
    zombie_ids = set(zombie1.episode_ids) | set(zombie2.episode_ids)
    assert audit["produced"] == 40 and audit["batched"] == 40
    assert_nothing_lost(audit, prompts="none")  # episodes fed straight to the topic: no prompt to account for
    assert audit["in_two_batches"] == len(zombie_ids) == audit["in_two_batches_refused"]
    assert audit["refused_batches"] == 2 and audit["refused_episodes"] == len(zombie_ids)
    assert audit["trained"] == 40 and audit["trained_twice"] == 0
