"""The generator's multi-turn loop (producers/multiturn.py) with a scripted engine and in-process environments:
masks, turn ids and versions of the Episodes it produces, and every stated outcome of bad environment behaviour.
(The same loop against real replicas, vLLM and the brokers: tests/integration/test_multiturn.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from envs.api import EnvObservation, EnvStepFailed, EnvTimeout, NoReplica, ReplicaLost
from envs.builtin_blackjack import BlackjackAction, BlackjackEnv
from envs.builtin_calculator import CalculatorAction, CalculatorEnv
from envs.config import EnvConfig
from models.tiny_model import EOS_ID, build_tokenizer
from producers.engine import Completion, Sampling
from producers.multiturn import MultiTurnPipeline, TurnRenderer
from topics.names import Names
from topics.schemas import Episode, Prompt

TOK = build_tokenizer()


class ScriptedEngine:
    """Answers each turn with the next action of ``script(prompt text)``; ``swap_after`` turns bump the version."""

    def __init__(self, script: Any, *, swap_after: int = 0) -> None:
        self.script, self.swap_after, self.version, self.calls = script, swap_after, 0, 0
        self.max_model_len = 256

    async def generate(self, tokens: list[int], n: int, sampling: Sampling, *, request_id: str = "") -> list[Completion]:
        self.calls += 1
        if self.swap_after and self.calls == self.swap_after + 1:
            self.version += 1
        text = self.script(TOK.decode(tokens, skip_special_tokens=True))
        ids = list(TOK(text, add_special_tokens=False)["input_ids"]) + [EOS_ID]
        ids = ids[:sampling.max_tokens]
        return [Completion(index=0, token_ids=ids, logprobs=[-0.5] * len(ids), versions=[self.version] * len(ids),
                           text=text, finish_reason="stop" if len(ids) < sampling.max_tokens else "length")]


class LocalSession:
    def __init__(self, router: LocalRouter, replica_id: str) -> None:
        self.router, self.replica_id, self.env_name = router, replica_id, "test"
        self.env = router.factory()
        self.steps = 0

    def _check(self) -> None:
        if self.replica_id in self.router.dead:
            raise ReplicaLost("gone", env_name="test", replica_id=self.replica_id)

    async def reset(self, *, seed: int | None = None, episode_id: str | None = None,
                    options: dict[str, Any] | None = None) -> EnvObservation:
        self._check()
        o = self.env.reset(seed=seed, episode_id=episode_id)
        return EnvObservation(text=o.text, done=o.done, reward=o.reward, info={"tool_call": getattr(o, "tool_call", False)})

    async def step(self, action: str, *, timeout_s: float | None = None) -> EnvObservation:
        self._check()
        self.steps += 1
        if self.router.kill_at_step and self.steps == self.router.kill_at_step and self.replica_id == "r0":
            self.router.dead.add("r0")
            self._check()
        if action == "boom":
            raise EnvStepFailed("the environment broke", env_name="test", replica_id=self.replica_id)
        if action == "slow":
            raise EnvTimeout("step took longer than 1 s", env_name="test", replica_id=self.replica_id)
        if action == "flood":
            return EnvObservation(text="x" * 5000)
        o = self.env.step(self.router.action_cls(text=action))
        return EnvObservation(text=o.text, done=o.done, reward=o.reward, info={"tool_call": getattr(o, "tool_call", False)})

    async def close(self) -> None:
        pass


class LocalRouter:
    def __init__(self, factory: Any, action_cls: Any, replicas: tuple[str, ...] = ("r0", "r1")) -> None:
        self.factory, self.action_cls, self.replicas = factory, action_cls, replicas
        self.dead: set[str] = set()
        self.kill_at_step = 0
        self.opened: list[str] = []

    async def open(self, env_name: str, *, exclude: Collection[str] = ()) -> LocalSession:
        for r in self.replicas:
            if r not in self.dead and r not in exclude:
                self.opened.append(r)
                return LocalSession(self, r)
        raise NoReplica("none left", env_name=env_name)


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[Episode] = []

    async def enqueue(self, topic: str, msg: Episode, *, key: str) -> asyncio.Future:
        self.sent.append(msg)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


class FakeDead:
    def __init__(self) -> None:
        self.letters: list[tuple[str, str]] = []

    async def send_message(self, source: str, msg: Any, *, reason: str, detail: str = "") -> None:
        self.letters.append((reason, detail))


def run_group(router: LocalRouter, engine: ScriptedEngine, *, group_size: int = 2, max_tokens: int = 120,
              **env_kw: Any) -> tuple[MultiTurnPipeline, FakeProducer, FakeDead]:
    producer, dead = FakeProducer(), FakeDead()
    pipe = MultiTurnPipeline(
        engine=engine, router=router, env=EnvConfig(name="test", **env_kw), renderer=TurnRenderer(TOK),
        producer=producer, dead=dead, names=Names("t"), generator_id="g0", sampling=Sampling(max_tokens=max_tokens),
        group_size=group_size, max_seq_len=256, stats={"prompts": 0, "episodes": 0, "tokens": 0, "dead_lettered": 0})
    prompt = Prompt(prompt_id="p-0", task="env:test", text="test", metadata={"seed": 7})
    asyncio.run(pipe.run(prompt, [], None))
    return pipe, producer, dead


def blackjack(**kw: Any) -> LocalRouter:
    return LocalRouter(BlackjackEnv, BlackjackAction, **kw)


def test_a_blackjack_episode_interleaves_masked_observations_and_swaps_show_per_token():
    """hit, hit, ... until the hand ends: model turns masked 1 with their versions, observations 0 and -1."""
    engine = ScriptedEngine(lambda text: "hit", swap_after=1)
    _, producer, dead = run_group(blackjack(), engine, group_size=1)
    [ep] = producer.sent
    assert not dead.letters and ep.finish_reason == "done" and ep.turns >= 2
    mask, turns, versions = ep.token_mask, ep.turn_ids, ep.token_versions
    hit = list(TOK("hit", add_special_tokens=False)["input_ids"]) + [EOS_ID]
    assert ep.response_tokens[:4].tolist() == hit and mask[:4].tolist() == [1, 1, 1, 1]
    assert (versions[mask == 1][:4] == 0).all() and (versions[mask == 1][4:8] == 1).all()  # the swap
    assert (versions[mask == 0] == -1).all() and (ep.logprobs[mask == 0] == 0).all()
    first_obs = TOK.decode(ep.response_tokens[mask == 0][turns[mask == 0] == 0].tolist())
    assert first_obs.startswith("you ") and first_obs.endswith(": ")
    assert ep.reward == ep.final_reward == -1.0 and len(ep.turn_rewards) == ep.turns  # hitting forever busts
    assert TOK.decode(ep.prompt_tokens.tolist(), skip_special_tokens=True).startswith("you ")
    assert ep.env_name == "test" and ep.env_replica == "r0" and ep.min_version == 0
    assert ep.model_mask.sum() == 4 * ep.turns


def test_the_group_shares_one_deal():
    pipe, producer, _ = run_group(blackjack(), ScriptedEngine(lambda text: "stand"), group_size=3)
    assert len({ep.prompt_tokens.tobytes() for ep in producer.sent}) == 1
    assert len({ep.reward for ep in producer.sent}) == 1 and pipe.stats["episodes"] == 3
    assert pipe.counts["done"] == 3


def test_a_tool_call_is_answered_in_the_context_and_counted():
    def script(text: str) -> str:
        words = text.replace(".", " ").split()
        if "<result>" not in text:
            a, b = [w for w in words if w.isdigit()][:2]
            op = "*" if "boxes" in words else "+" if "more" in words else "-"
            return f"<calc>{a}{op}{b}</calc>"
        return text.rsplit("<result>", 1)[1].split("</result>")[0]

    _, producer, _ = run_group(LocalRouter(CalculatorEnv, CalculatorAction), ScriptedEngine(script))
    for ep in producer.sent:
        assert ep.reward == 1.0 and ep.tool_calls == 1 and ep.turns == 2 and ep.finish_reason == "done"
        env_text = TOK.decode(ep.response_tokens[ep.token_mask == 0].tolist())
        assert env_text.startswith("<result>") and env_text.endswith("</result>")


def test_a_rejected_action_ends_the_episode_with_the_penalty():
    _, producer, dead = run_group(blackjack(), ScriptedEngine(lambda text: "fold"), penalty=-2.0)
    assert not dead.letters and all(ep.finish_reason == "rejected" and ep.reward == -2.0 for ep in producer.sent)


def test_a_lost_replica_restarts_the_episode_on_another():
    router = blackjack()
    router.kill_at_step = 1
    pipe, producer, dead = run_group(router, ScriptedEngine(lambda text: "stand"), group_size=1)
    [ep] = producer.sent
    assert ep.env_replica == "r1" and ep.env_restarts == 1 and pipe.counts["restarts"] == 1 and not dead.letters


def test_beyond_max_restarts_the_episode_is_dead_lettered():
    router = blackjack(replicas=("r0",))
    router.kill_at_step = 1
    pipe, producer, dead = run_group(router, ScriptedEngine(lambda text: "stand"), group_size=1, max_restarts=2,
                                     step_timeout_s=0.1)
    assert not producer.sent and dead.letters[0][0] == "replica_lost" and pipe.counts["replica_lost"] == 1


@pytest.mark.parametrize("action, reason", [("boom", "env_step_failed"), ("slow", "env_timeout")])
def test_an_environment_that_fails_dead_letters_the_episode(action: str, reason: str):
    pipe, producer, dead = run_group(blackjack(), ScriptedEngine(lambda text: action), group_size=2)
    assert not producer.sent and [r for r, _ in dead.letters] == [reason, reason]
    assert pipe.stats["dead_lettered"] == 2 and pipe.counts[reason] == 2


def test_an_observation_too_long_for_the_sequence_truncates():
    _, producer, _ = run_group(blackjack(), ScriptedEngine(lambda text: "flood"), group_size=1)
    [ep] = producer.sent
    assert ep.finish_reason == "truncated" and ep.token_mask.tolist() == [1] * len(ep.response_tokens)


def test_max_turns_and_the_token_budget_end_the_episode():
    calc = LocalRouter(CalculatorEnv, CalculatorAction)
    _, producer, _ = run_group(calc, ScriptedEngine(lambda text: "<calc>1+1</calc>"), group_size=1, max_turns=3)
    assert producer.sent[0].finish_reason == "max_turns" and producer.sent[0].turns == 3
    _, producer, _ = run_group(calc, ScriptedEngine(lambda text: "<calc>1+1</calc>"), group_size=1, max_tokens=40)
    ep = producer.sent[0]
    assert ep.finish_reason in ("length", "truncated") and len(ep.response_tokens) <= 40
    assert np.all(np.diff(ep.turn_ids) >= 0)


@pytest.mark.parametrize("config", ["blackjack", "calculator", "calculator-smollm2"])
def test_shipped_multiturn_configs_load_and_a_foreign_env_source_names_its_key(config: str):
    from streamforge.config import load_config
    from topics.errors import ConfigError

    path = Path(__file__).resolve().parents[2] / "configs" / f"{config}.yaml"
    cfg = load_config(path, [], environ={})
    assert cfg.feeder.source == f"env:{cfg.env.name}" and cfg.env.impl in ("blackjack", "calculator")
    with pytest.raises(ConfigError, match="feeder.source"):
        load_config(path, ["--feeder.source=env:other"], environ={})
