"""The buffer role against real brokers: episodes in, batches and drops out, counts reconcile, backpressure."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson
import pytest

from buffer.synthetic import make_group
from helpers.audits import assert_nothing_lost
from helpers.configs import unbounded
from streamforge.audit import run_audit
from streamforge.roles import build_role
from topics.admin import read_topic
from topics.kafka import Consumer, Producer, TopicPartition
from topics.nats import PolicyStore, connect
from topics.schemas import Batch, DropRecord, PolicyVersion
from weightsync.members import FENCED_KEY

pytestmark = pytest.mark.timeout(120)


def with_buffer(cfg, **kw):
    """A buffer run alone: no trainer publishes versions, so no batches-ahead cap unless a test sets one."""
    return unbounded(cfg, **kw)


async def produce(cfg, episodes, *, raw: list[bytes] = ()) -> None:
    async with Producer(cfg.kafka) as producer:
        futs = [await producer.enqueue(cfg.names.episodes, e, key=e.group_id) for e in episodes]
        futs += [await producer.enqueue_raw(cfg.names.episodes, b, key="junk") for b in raw]
        await asyncio.gather(*futs)


async def wait_for(predicate, timeout_s: float, what: str, role=None, task=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if task is not None and task.done():
            task.result()  # raises the role's crash
            raise AssertionError(f"the role stopped before {what}")
        if time.monotonic() > deadline:
            extra = role.all_counters() if role is not None else ""
            raise AssertionError(f"timed out waiting for {what} {extra}")
        await asyncio.sleep(0.1)


async def test_episodes_in_batches_out_counts_reconcile(run_config):
    cfg = with_buffer(run_config, groups_per_batch=2, max_policy_lag=1, max_response_tokens=20,
                      max_batch_wait_s=0.5, group_timeout_s=3.0)
    # the policy is at version 5: groups sampled at version 3 are stale
    nc = await connect(cfg.nats, name="test")
    store = PolicyStore(nc, cfg.names)
    await store.start()
    await store.publish(PolicyVersion(version=5, step=5), expected_revision=0)

    good = [e for g in range(6) for e in make_group(f"g{g}", 4, version=5)]
    stale = make_group("stale", 4, version=3)
    flat = make_group("flat", 4, version=5, rewards=[1.0] * 4)
    long = make_group("long", 4, version=5, response_len=30)  # every response over 20 tokens
    partial = make_group("partial", 4, version=5)[:2]  # never completes
    dup = good[:2]  # redelivered records
    episodes = [*good, *stale, *flat, *long, *partial, *dup]
    await produce(cfg, episodes, raw=[b"\x00not msgpack", b"\x81\xa6schema\xa3zzz"])

    role = build_role("buffer", cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    try:
        expected = len(good) + 4 + 4 + 4 + 2  # every distinct episode, the incomplete pair after its timeout
        await wait_for(lambda: role.state.counters["batched_episodes"] + sum(
            v for k, v in role.state.counters.items() if k.startswith("dropped_") and k != "dropped_duplicate"
        ) >= expected and role.state.held == 0, 30, "every episode decided", role, task)
        assert role.latest_version == 5
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await nc.close()

    records = await read_topic(cfg.kafka, cfg.names.batches, expect=Batch)
    batches = [r.value for r in records]
    assert [r.key for r in records] == [b.batch_id for b in batches]
    assert sum(len(b.episode_ids) for b in batches) == 24
    for b in batches:
        assert set(b.group_ids) <= {f"g{i}" for i in range(6)} and len(b.episode_ids) == b.input_ids.shape[0]
        assert np.isfinite(b.advantages).all() and abs(float(b.advantages.sum())) < 1e-3
        assert (b.token_versions[b.loss_mask.astype(bool)] == 5).all()
    # each batch carries the buffer's drop counters at its publication (the trainer puts them in metrics.jsonl)
    previous: dict[str, float] = {}
    for b in batches:
        counts = {k.removeprefix("dropped/"): v for k, v in b.stats.items() if k.startswith("dropped/")}
        assert all(counts.get(k, 0.0) >= v for k, v in previous.items()), (previous, counts)
        previous = counts
    drops = [r.value for r in await read_topic(cfg.kafka, cfg.names.drops, expect=DropRecord)]
    reasons = {}
    for d in drops:
        reasons.setdefault(d.reason, set()).update(d.episode_ids)
    assert reasons["stale"] == {e.episode_id for e in stale}
    assert reasons["zero_variance"] == {e.episode_id for e in flat}
    assert reasons["overlong"] == {e.episode_id for e in long}
    assert reasons["incomplete"] == {e.episode_id for e in partial}
    final = {r: len(ids) for r, ids in reasons.items()} | {"malformed": 2}
    assert all(v <= final.get(k, 0) for k, v in previous.items()), (previous, final)

    audit = await run_audit(cfg)
    assert audit["produced"] == len(episodes) - len(dup) == 38 and audit["duplicate_records"] == 2
    assert audit["batched"] == 24, audit
    assert_nothing_lost(audit, prompts="none")  # episodes fed straight to the topic: no prompt to account for
    assert audit["dropped"]["duplicate"] == 2 and audit["dropped"]["malformed"] == 2
    assert audit["in_two_batches"] == 0 and audit["batched_and_dropped"] == 0
    # the committed offsets cover every record: a new buffer in the group would start at the end
    assert role.counters["dead_lettered"] == 2 and role.counters["commits"] >= 1


async def test_backpressure_caps_held_episodes(run_config):
    cap = 12
    cfg = with_buffer(run_config, groups_per_batch=1, max_pending_episodes=cap, group_timeout_s=1.5,
                      poll_max_records=5)
    # groups whose last episode never comes: the buffer must not read the whole backlog into memory
    heads = [e for g in range(10) for e in make_group(f"h{g}", 4)[:3]]
    await produce(cfg, heads)
    role = build_role("buffer", cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    peak = 0
    try:
        deadline = time.monotonic() + 40
        # the group timeout frees room; consumption resumes and everything is eventually decided
        while role.state.counters.get("dropped_incomplete", 0) < len(heads):
            assert time.monotonic() < deadline and not task.done(), role.all_counters()
            peak = max(peak, role.state.held)
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert 0 < peak <= cap and role.counters["pauses"] >= 1


async def test_graceful_stop_publishes_partial_batch_and_commits(run_config):
    cfg = with_buffer(run_config, groups_per_batch=4, max_batch_wait_s=60.0)
    episodes = make_group("a", 4) + make_group("b", 4) + make_group("c", 4)[:2]  # c stays incomplete
    await produce(cfg, episodes)
    role = build_role("buffer", cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    try:
        await wait_for(lambda: role.state.counters["received"] == len(episodes), 30, "all received", role, task)
        assert role.state.counters["batches"] == 0  # two groups wait for two more
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    (batch,) = [r.value for r in await read_topic(cfg.kafka, cfg.names.batches, expect=Batch)]
    assert batch.group_ids == ["a"] * 4 + ["b"] * 4
    # committed: everything before c's first episode; c is replayed by the next buffer
    probe = Consumer(cfg.kafka, [], group_id=cfg.names.buffers_group)
    await probe.start()
    try:
        committed = {}
        for p in range(cfg.topics.episodes_partitions):
            committed[p] = await probe.committed(TopicPartition(cfg.names.episodes, p))
    finally:
        await probe.stop()
    records = await read_topic(cfg.kafka, cfg.names.episodes)
    c_part = next(r.partition for r in records if r.key == "c")
    first_c = min(r.offset for r in records if r.key == "c")
    assert committed[c_part] == first_c
    for p in {r.partition for r in records if r.key in ("a", "b")} - {c_part}:
        assert committed[p] == max(r.offset for r in records if r.partition == p) + 1


async def test_stalled_trainer_holds_groups_then_stale_ones_are_dropped(run_config):
    cfg = with_buffer(run_config, groups_per_batch=1, max_batches_ahead=2, max_pending_episodes=16,
                      max_policy_lag=1, max_batch_wait_s=0.2, poll_max_records=4)
    nc = await connect(cfg.nats, name="test-trainer")
    store = PolicyStore(nc, cfg.names)
    await store.start()
    rev = await store.publish(PolicyVersion(version=1, step=0), expected_revision=0)
    old = [e for g in range(10) for e in make_group(f"old{g}", 4, version=1)]
    await produce(cfg, old)
    role = build_role("buffer", cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    try:
        # the trainer trains nothing: two batches go out, then groups wait in memory up to the cap, then it pauses
        await wait_for(lambda: role.counters["pauses"] >= 1, 30, "the pause", role, task)
        await asyncio.sleep(1.0)
        assert role.state.counters["batches"] == 2 and role.state.held == 16
        assert role.state.counters["received"] == 8 + 16  # the rest of the backlog is still in Kafka
        # the trainer resumes: two steps trained, version 3 published; held version-1 groups are now stale
        await store.publish(PolicyVersion(version=3, step=2), expected_revision=rev)
        fresh = [e for g in range(3) for e in make_group(f"new{g}", 4, version=3)]
        await produce(cfg, fresh)
        await wait_for(lambda: role.state.counters.get("dropped_stale", 0) == 32 and role.state.held == 4, 30,
                       "stale groups dropped, fresh ones batched up to the limit", role, task)
        assert role.state.counters["batches"] == 4  # 2 before + 2 allowed by step 2; one fresh group waits
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await nc.close()


async def test_fenced_generator_episodes_are_dropped(run_config):
    cfg = with_buffer(run_config, groups_per_batch=1, max_policy_lag=5)
    nc = await connect(cfg.nats, name="test-trainer")
    store = PolicyStore(nc, cfg.names)
    await store.start()
    # what the trainer's weight publisher writes when gen-late missed version 3 (last acknowledged: 2)
    await store.put(FENCED_KEY, orjson.dumps({"gen-late": {"last_acked_version": 2, "fenced_at": 0.0,
                                                           "missed_version": 3}}))
    late = make_group("late", 4, version=3)
    ok = make_group("ok", 4, version=3)
    for e in late:
        e.generator_id = "gen-late"
    await produce(cfg, late + ok)
    role = build_role("buffer", cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    try:
        await wait_for(lambda: role.state.counters.get("dropped_fenced", 0) == 4
                       and role.state.counters["batched_episodes"] == 4, 30, "fenced drop and batch", role, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await nc.close()
    drops = [r.value for r in await read_topic(cfg.kafka, cfg.names.drops, expect=DropRecord)]
    assert [(d.reason, sorted(d.episode_ids)) for d in drops] == [("fenced", [e.episode_id for e in late])]


async def test_packed_batches_out_hold_every_episode_once(run_config):
    cfg = with_buffer(run_config, groups_per_batch=3, max_batch_wait_s=0.5, batching="pack", pack_row_tokens=64,
                      budget_count="tokens")
    lengths = [(6, 10), (12, 30), (4, 4), (9, 17), (20, 40), (5, 8)]  # rows of 16..60 tokens
    episodes = [e for i, (p, r) in enumerate(lengths) for e in make_group(f"p{i}", 4, prompt_len=p, response_len=r)]
    await produce(cfg, episodes)
    role = build_role("buffer", cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    try:
        await wait_for(lambda: role.state.counters["batched_episodes"] == len(episodes), 30, "all batched", role, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    batches = [r.value for r in await read_topic(cfg.kafka, cfg.names.batches, expect=Batch)]  # decoded: validated
    assert batches and all(b.packed and b.input_ids.shape[1] == 64 for b in batches)
    assert sum(b.input_ids.shape[0] for b in batches) < len(episodes)  # several episodes per row
    by_id = {e.episode_id: e for e in episodes}
    for b in batches:
        for i, eid in enumerate(b.episode_ids):
            r, c = np.nonzero(b.segment_ids == i)
            ep = by_id[eid]
            assert np.array_equal(b.input_ids[r, c], np.concatenate([ep.prompt_tokens, ep.response_tokens]))
            assert np.array_equal(b.old_logprobs[r, c][len(ep.prompt_tokens):], ep.logprobs)
    audit = await run_audit(cfg)
    assert audit["batched"] == len(episodes) and audit["in_two_batches"] == 0
    assert_nothing_lost(audit, prompts="none")
