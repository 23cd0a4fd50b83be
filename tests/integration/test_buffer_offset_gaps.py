"""The buffer at a real offset hole of the embedded broker: it never commits past the hole, reports its health as
failing naming partition and offset while it keeps re-reading, and a restarted buffer, which starts right at the
hole, does the same. The hole is real (``tests/helpers/holes.py``): a record batch whose records skip offset
deltas, as compaction leaves them; the consumer receives the records around it and never the missing ones."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest

from buffer.synthetic import make_group
from helpers.configs import unbounded
from helpers.holes import produce_with_holes
from streamforge.audit import run_audit
from streamforge.roles import build_role
from topics import codec
from topics.admin import group_offsets
from topics.kafka import Producer

pytestmark = pytest.mark.timeout(150)

PARTITION = 2


async def wait_for(predicate, timeout_s: float, what: str, role, task) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if task.done():
            task.result()  # raises the role's crash
            raise AssertionError(f"the role stopped before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {role.all_counters()}")
        await asyncio.sleep(0.05)


async def committed(cfg) -> int | None:
    return (await group_offsets(cfg.kafka, cfg.names.buffers_group, cfg.names.episodes)).get(PARTITION)


async def test_a_hole_is_never_committed_past_and_the_health_names_it(run_config):
    cfg = unbounded(run_config, groups_per_batch=1, max_batch_wait_s=0.3, group_timeout_s=60.0,
                    offset_gap_fail_s=1.0, commit_interval_s=0.0)
    g0, g1 = make_group("g0", 4), make_group("g1", 4)
    async with Producer(cfg.kafka) as producer:  # offsets 0-3: a whole group
        await asyncio.gather(*[await producer.enqueue(cfg.names.episodes, e, key=e.group_id, partition=PARTITION)
                               for e in g0])
    # offsets 4 (a malformed record) and 7 (g1's first episode); 5 and 6 never exist
    base = await produce_with_holes(cfg.kafka.bootstrap, cfg.names.episodes, PARTITION,
                                    [(0, b"junk", b"\x00not msgpack"), (3, b"g1", codec.encode(g1[0]))])
    assert base == 4
    async with Producer(cfg.kafka) as producer:  # offsets 8-10: the rest of g1
        await asyncio.gather(*[await producer.enqueue(cfg.names.episodes, e, key=e.group_id, partition=PARTITION)
                               for e in g1[1:]])

    role = build_role("buffer", cfg)
    health_file = Path(cfg.run.run_dir) / f"health-{role.buffer_id}.json"
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    try:
        await wait_for(lambda: role.gaps.failing, 40, "a failing health", role, task)  # said and written
        health = role.health()
        assert health["gaps"][0]["partition"] == PARTITION and health["gaps"][0]["offset"] == 5, health
        assert f"partition {PARTITION}: offset 5 not received" in health["reason"]
        written = orjson.loads(health_file.read_bytes())
        assert written["state"] == "failing" and written["gaps"][0]["offset"] == 5 and written["id"] == role.buffer_id
        # what came before the hole was handled: g0 batched, the malformed record dead-lettered
        await wait_for(lambda: role.state.counters["batched_episodes"] == 4, 10, "g0 batched", role, task)
        assert role.counters["dead_lettered"] == 1
        await wait_for(lambda: role.counters["commits"] >= 1, 10, "a commit", role, task)
        assert await committed(cfg) == 5  # the first offset not received, never beyond
        seeks = role.counters["offset_gap_seeks"]
        await asyncio.sleep(2.0)
        assert not task.done()  # still running, still re-reading, still holding the commit
        assert role.counters["offset_gap_seeks"] > seeks >= 2
        assert role.counters["offset_gaps"] == 1 and role.counters["offset_gaps_failing"] == 1
        assert role.counters["offset_gaps_skipped"] == 0 and role.counters["offset_gaps_healed"] == 0
        assert role.state.counters["received"] == 4  # g0 (and the malformed record, dead-lettered); nothing beyond
        assert await committed(cfg) == 5
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert await committed(cfg) == 5  # the drain's forced commit does not pass it either

    # a buffer started afresh begins at the committed offset, right at the hole: a gap at its start is one too
    role2 = build_role("buffer", cfg)
    stop2 = asyncio.Event()
    task2 = asyncio.create_task(role2.serve(stop2))
    try:
        await wait_for(lambda: role2.health()["state"] == "failing", 40, "the restarted buffer failing", role2, task2)
        assert role2.health()["gaps"][0]["offset"] == 5 and role2.state.counters["received"] == 0
    finally:
        stop2.set()
        await asyncio.wait_for(task2, 30)
    assert await committed(cfg) == 5

    audit = await run_audit(cfg)
    assert audit["lost"] == 0 and audit["batched"] == 4, audit  # g1 waits beyond the hole: pending, not lost
    assert audit["pending"] == 4, audit
