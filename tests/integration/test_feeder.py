"""The feeder against real brokers: prompts keyed by id, bounded by the generators' committed offsets."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from producers.feeder import GroupOffsets
from producers.sources import toy_prompts
from streamforge.roles import build_role
from topics.admin import read_topic
from topics.kafka import Consumer
from topics.schemas import Prompt, SFTExample

pytestmark = pytest.mark.timeout(120)


def with_feeder(cfg, **kw):
    return dataclasses.replace(cfg, feeder=dataclasses.replace(cfg.feeder, **kw))


async def wait_until(predicate, timeout_s: float, what: str, task: asyncio.Task) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if task.done():
            task.result()
            raise AssertionError(f"the feeder stopped before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_feeds_prompts_keyed_by_id_and_waits_for_the_generators(run_config):
    cfg = with_feeder(run_config, source="toy:reverse", num_prompts=10, max_in_flight=4, seed=3)
    feeder = build_role("feeder", cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(feeder.serve(stop))
    await wait_until(lambda: feeder.sent == 4, 30, "4 prompts", task)
    await asyncio.sleep(1.5)  # no generator has committed anything: the feeder holds at max_in_flight
    assert feeder.sent == 4 and not feeder.finished.is_set()

    # a generator of the group takes and commits everything it sees; the feeder refills up to the end
    gen = Consumer(cfg.kafka, [cfg.names.prompts], group_id=cfg.names.generators_group, expect=Prompt)
    await gen.start()
    try:
        seen: list = []
        deadline = time.monotonic() + 60
        while len(seen) < 10:
            assert time.monotonic() < deadline, f"only {len(seen)} prompts reached the generator group"
            recs = await gen.getmany(timeout_ms=300)
            seen.extend(recs)
            if recs:
                await gen.commit({r.tp: r.offset + 1 for r in recs})
        await wait_until(feeder.finished.is_set, 10, "the end of the source", task)
    finally:
        await gen.stop()
    stop.set()
    await asyncio.wait_for(task, 30)

    records = await read_topic(cfg.kafka, cfg.names.prompts, expect=Prompt)
    expected = [p for _, p in zip(range(10), toy_prompts("reverse", seed=3))]
    assert sorted(r.value.prompt_id for r in records) == sorted(p.prompt_id for p in expected)
    assert all(r.key == r.value.prompt_id for r in records)
    by_id = {r.value.prompt_id: r.value for r in records}
    assert all(by_id[p.prompt_id].text == p.text and by_id[p.prompt_id].answer == p.answer for p in expected)

    reader = GroupOffsets(cfg.kafka, cfg.names.generators_group, cfg.names.prompts)
    await reader.start()
    try:
        committed = await reader.read()
    finally:
        await reader.stop()
    assert sum(committed.values()) == 10


async def test_sft_source_goes_to_the_sft_topic(run_config, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text('{"prompt": "1+1=", "completion": "2", "id": "a"}\n{"prompt": "2+2=", "completion": "4"}\n')
    cfg = with_feeder(run_config, source=f"sft_jsonl:{path}", num_prompts=3)
    feeder = build_role("feeder", cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(feeder.serve(stop))
    await wait_until(feeder.finished.is_set, 30, "the end of the source", task)
    stop.set()
    await asyncio.wait_for(task, 30)
    records = await read_topic(cfg.kafka, cfg.names.sft, expect=SFTExample)
    assert sorted(r.value.example_id for r in records) == ["a", "a@e1", "sft-1"]
    assert all(r.key == r.value.example_id for r in records)
