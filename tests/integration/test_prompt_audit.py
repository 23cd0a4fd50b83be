"""Exactly once from the prompt, against real brokers, a real vLLM CPU engine and the real generator role (its
intake, consumer group and commits): every prompt below the generators group's committed offset is answered,
dead-lettered or unanswered for a stated reason, and ``run_audit`` says which; one a generator committed past
without producing anything is reported lost, by partition, offset and prompt id.

* the defect injected: the generator's prompt runner returns for one chosen prompt (by its place on the topic)
  without producing: its offset is committed as usual, and the audit names it, ``lost`` 1, ``reconciles`` false;
* the clean counterpart, with every outcome: answered (a prompt id fed twice, each answered), dead-lettered (a
  record that does not decode, a prompt no engine can take), unanswered (every reward raised): nothing lost;
* an environment that refuses every reset (a real replica): the prompts are unanswered with ``env_step_failed``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
from test_generator import committed_offsets, configure, stop_role

from helpers.audits import assert_nothing_lost
from helpers.replicas import FAST_BEATS, start_role, stop
from models.tiny_model import build_tiny_model
from producers.engine import Engine
from producers.pipeline import PromptPipeline
from runtime.services import ServiceDirectory
from streamforge.audit import run_audit
from streamforge.roles import build_role
from topics.admin import highwaters
from topics.kafka import Producer
from topics.nats import connect
from topics.schemas import Prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

RAISE = "tests.integration.test_generator:scripted_reward"  # raises for a prompt with metadata reward=raise


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
async def engine(model_dir):
    eng = Engine(str(model_dir), max_model_len=128, seed=0)
    await eng.start()
    yield eng
    await eng.stop()


def toy(i: int, **metadata) -> Prompt:
    return Prompt(prompt_id=f"p{i}", task="addmod10", text=f"{i}+1=", answer=str((i + 1) % 10), metadata=metadata)


async def feed(cfg, records: list[Prompt | bytes]) -> list[tuple[int, int]]:
    """Produce each prompt (or raw bytes) to the prompts topic; their places, ``(partition, offset)``, in order."""
    places = []
    async with Producer(cfg.kafka) as producer:
        for rec in records:
            if isinstance(rec, bytes):
                meta = await producer.send_raw(cfg.names.prompts, rec, key="junk")
            else:
                meta = await producer.send(cfg.names.prompts, rec, key=rec.prompt_id)
            places.append((meta.partition, meta.offset))
    return places


async def run_generator(cfg, engine, timeout_s: float = 120) -> object:
    """The generator role until the group has committed every prompt on the topic, then stopped (drained)."""
    role = build_role("generator", cfg, engine=engine)
    stop_event = asyncio.Event()
    task = asyncio.create_task(role.serve(stop_event))
    ends = {p: hw for p, hw in (await highwaters(cfg.kafka, cfg.names.prompts)).items() if hw}
    deadline = time.monotonic() + timeout_s
    while await committed_offsets(cfg) != ends:
        if task.done():
            task.result()
            raise AssertionError("the generator stopped before committing every prompt")
        assert time.monotonic() < deadline, f"committed {await committed_offsets(cfg)}, fed up to {ends}"
        await asyncio.sleep(0.2)
    await stop_role(stop_event, task)
    return role


async def test_a_prompt_committed_without_its_group_is_reported_lost_by_place_and_id(run_config, engine, model_dir,
                                                                                      monkeypatch):
    cfg = configure(run_config, model_dir, group_size=2, max_tokens=4, rewards=["toy"], generator_id="g-defect")
    prompts = [toy(i) for i in range(5)]
    places = await feed(cfg, prompts)
    victim = places[2]
    real_run = PromptPipeline.run

    async def run(self, prompt, tokens, ctx, origin=None):
        if origin == victim:
            return  # the defect: "done", so the intake commits past it, with no group and no word why
        await real_run(self, prompt, tokens, ctx, origin)

    monkeypatch.setattr(PromptPipeline, "run", run)
    role = await run_generator(cfg, engine)
    assert role.stats["prompts"] == 4 and role.stats["dead_lettered"] == 0  # the other four went through

    audit = await run_audit(cfg)
    block = audit["prompts"]
    assert block["consumed"] == 5 and block["answered"] == 4 and block["pending"] == 0
    assert block["lost"] == 1 and block["samples"]["lost"] == [
        {"partition": victim[0], "offset": victim[1], "prompt_id": "p2"}]
    assert audit["lost"] == 1 and audit["episodes_lost"] == 0 and not audit["reconciles"]


async def test_every_prompt_of_a_clean_run_is_answered_dead_lettered_or_unanswered(run_config, engine, model_dir):
    cfg = configure(run_config, model_dir, group_size=2, max_tokens=4, rewards=["toy", RAISE],
                    generator_id="g-clean")
    records = [toy(0), toy(1), toy(0),  # p0 fed twice (a restarted feeder): two prompts, each answered
               b"\xc1 not msgpack",  # undecodable: dead-lettered
               Prompt(prompt_id="long", task="addmod10", text="1+" * 100),  # no engine can take it: invalid
               toy(3, reward="raise")]  # every episode's reward raises: unanswered, reward_error
    places = await feed(cfg, records)
    role = await run_generator(cfg, engine)
    assert role.stats["prompts"] == 4 and role.stats["dead_lettered"] == 2 + 2  # two records, two episodes

    audit = await run_audit(cfg)
    block = assert_nothing_lost(audit)
    assert block["records"] == block["consumed"] == 6 and block["pending"] == 0
    assert block["answered"] == 3 and block["duplicate_ids"] == 1
    assert block["dead_lettered"] == 2 and block["unanswered_by_reason"] == {"reward_error": 1}
    assert audit["produced"] == 4 and audit["pending"] == 4  # p0's two groups share ids; no buffer ran
    assert len(set(places)) == 6


async def test_an_environment_that_refuses_every_reset_leaves_its_prompts_unanswered(run_config, engine,
                                                                                     model_dir):
    env = dataclasses.replace(run_config.env, name="refuse", impl="helpers.refusingenv:RefusingEnv", heartbeat_s=0.5,
                              health_timeout_s=1.5, step_timeout_s=5.0, max_turns=2, max_restarts=1)
    cfg = configure(dataclasses.replace(run_config, env=env), model_dir, group_size=3, max_tokens=30,
                    generator_id="g-refused")
    replica = start_role("env", cfg, cfg.run_dir / "logs" / "refuse-0.log", "--env.name=refuse",
                         "--env.impl=helpers.refusingenv:RefusingEnv", "--env.replica_id=refuse-0", *FAST_BEATS)
    nc = await connect(cfg.nats, name="test-refused")
    directory = ServiceDirectory(nc, cfg.names)
    try:
        await directory.start()
        await directory.wait_for("refuse", 1, timeout_s=90)
        await feed(cfg, [Prompt(prompt_id=f"deal-{i}", task="env:refuse", text="play", metadata={"seed": i})
                         for i in range(2)])
        role = await run_generator(cfg, engine)
    finally:
        await directory.stop()
        await nc.close()
        stop([replica])
    assert role.stats["episodes"] == 0 and role.stats["dead_lettered"] == 6
    assert role.pipeline.counts == {"env_step_failed": 6}

    audit = await run_audit(cfg)
    block = assert_nothing_lost(audit)
    assert block["consumed"] == 2 and block["answered"] == 0 and block["dead_lettered"] == 0
    assert block["unanswered_by_reason"] == {"env_step_failed": 2}
