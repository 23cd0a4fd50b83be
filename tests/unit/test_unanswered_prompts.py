"""A prompt whose every episode was dead-lettered leaves a stated record before its offset is committed: the
pipelines' ``UnansweredPrompt`` on the ``unanswered`` topic (producers/pipeline.py ``record_unanswered``), and
every Episode names its prompt's place on the prompts topic. Fakes stand in for the producer, engine and
environment here (the brokers' path: tests/integration/test_prompt_audit.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_multiturn_loop import TOK, FakeDead, FakeProducer, LocalRouter, ScriptedEngine, blackjack

from envs.api import EnvStepFailed
from envs.builtin_blackjack import BlackjackAction, BlackjackEnv
from envs.config import EnvConfig
from producers.engine import Completion, Sampling
from producers.multiturn import MultiTurnPipeline, TurnRenderer
from producers.pipeline import PromptPipeline, record_unanswered
from producers.rewards import RewardSet
from topics.names import Names
from topics.schemas import Episode, Prompt, UnansweredPrompt

NAMES = Names("t")


class RecordingProducer(FakeProducer):
    """Episodes through ``enqueue`` (as FakeProducer), acknowledged records through ``send``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, Any, str]] = []

    async def send(self, topic: str, msg: Any, *, key: str) -> None:
        self.records.append((topic, msg, key))


class RefusingRouter(LocalRouter):
    """Every session's reset raises, as an environment that refuses every reset does."""

    async def open(self, env_name: str, *, exclude=()):  # type: ignore[override]
        session = await super().open(env_name, exclude=exclude)

        async def reset(**kw: Any):
            raise EnvStepFailed("reset refused", env_name="test", replica_id=session.replica_id)

        session.reset = reset  # type: ignore[method-assign]
        return session


def multiturn(router: LocalRouter, producer: RecordingProducer, origin: tuple[int, int] | None,
              group_size: int = 3) -> MultiTurnPipeline:
    pipe = MultiTurnPipeline(
        engine=ScriptedEngine(lambda text: "stand"), router=router, env=EnvConfig(name="test"),
        renderer=TurnRenderer(TOK), producer=producer, dead=FakeDead(), names=NAMES, generator_id="g0",
        sampling=Sampling(max_tokens=60), group_size=group_size, max_seq_len=256,
        stats={"prompts": 0, "episodes": 0, "tokens": 0, "dead_lettered": 0})
    prompt = Prompt(prompt_id="p-0", task="env:test", text="test", metadata={"seed": 7})
    asyncio.run(pipe.run(prompt, [], None, origin))
    return pipe


def test_an_environment_that_refuses_every_reset_records_the_prompt_unanswered():
    producer = RecordingProducer()
    pipe = multiturn(RefusingRouter(BlackjackEnv, BlackjackAction), producer, (2, 17))
    assert not producer.sent and pipe.stats["dead_lettered"] == 3
    [(topic, record, key)] = producer.records
    assert topic == NAMES.unanswered and key == "p-0" and isinstance(record, UnansweredPrompt)
    assert (record.prompt_id, record.partition, record.offset) == ("p-0", 2, 17)
    assert record.reason == "env_step_failed" and record.episode_reasons == {"env_step_failed": 3}
    assert "reset refused" in record.detail and record.generator_id == "g0"


def test_a_prompt_from_a_local_source_has_no_place_and_no_record():
    producer = RecordingProducer()
    multiturn(RefusingRouter(BlackjackEnv, BlackjackAction), producer, None)
    assert producer.records == []


def test_a_played_group_names_its_prompts_place_and_leaves_no_record():
    producer = RecordingProducer()
    multiturn(blackjack(), producer, (1, 4), group_size=2)
    assert len(producer.sent) == 2 and producer.records == []
    assert {(ep.prompt_partition, ep.prompt_offset) for ep in producer.sent} == {(1, 4)}


def test_mixed_failures_are_recorded_as_mixed_with_each_reason_counted():
    producer = RecordingProducer()
    failures = [("env_step_failed", "a"), ("env_timeout", "b"), ("env_step_failed", "c")]
    asyncio.run(record_unanswered(producer, NAMES, Prompt(prompt_id="q", task="t"), (0, 3), failures,
                                  generator_id="g1"))
    [(_, record, _)] = producer.records
    assert record.reason == "mixed" and record.episode_reasons == {"env_step_failed": 2, "env_timeout": 1}
    assert record.detail == "a"


class OneAnswerEngine:
    version = 0

    async def generate(self, tokens: list[int], n: int, sampling: Sampling, *, request_id: str = "") -> list[Completion]:
        return [Completion(index=i, token_ids=[5], logprobs=[-0.5], versions=[0], text="7", finish_reason="stop")
                for i in range(n)]


def refuse(prompt: Prompt, response_text: str) -> float:
    raise ValueError("no score for this")


@pytest.mark.parametrize("rewards, unanswered", [(["toy"], False), ([f"{__name__}:refuse"], True)])
def test_a_group_whose_every_reward_failed_records_the_prompt_unanswered(rewards: list[str], unanswered: bool):
    producer = RecordingProducer()
    rewards_set = RewardSet(rewards, timeout_s=5.0)
    pipe = PromptPipeline(engine=OneAnswerEngine(), rewards=rewards_set, producer=producer, dead=FakeDead(),
                          names=NAMES, generator_id="g2", sampling=Sampling(max_tokens=2), group_size=2,
                          stats={"prompts": 0, "episodes": 0, "tokens": 0, "dead_lettered": 0})
    prompt = Prompt(prompt_id="r-1", task="addmod10", text="3+4=", answer="7")
    try:
        asyncio.run(pipe.run(prompt, [1, 2, 3], None, (3, 9)))
    finally:
        rewards_set.close()
    if unanswered:
        [(topic, record, _)] = producer.records
        assert not producer.sent and topic == NAMES.unanswered
        assert (record.partition, record.offset, record.reason) == (3, 9, "reward_error")
        assert record.episode_reasons == {"reward_error": 2} and "no score for this" in record.detail
    else:
        assert producer.records == [] and len(producer.sent) == 2
        assert all(isinstance(ep, Episode) and (ep.prompt_partition, ep.prompt_offset) == (3, 9)
                   for ep in producer.sent)
