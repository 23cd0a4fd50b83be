"""The generator's multi-turn loop: one GRPO group of episodes played against an environment's replicas.

``MultiTurnPipeline.run(prompt, tokens, ctx, origin)`` replaces the single-turn pipeline when ``env.name`` is set (the
feeder's ``env:<name>`` source). The group's ``group_size`` episodes run concurrently, each in its own sticky
session (``envs.api.EnvRouter``), all reset with the prompt's ``metadata["seed"]`` (one deal, one problem: the
group compares the policy's decisions). One episode:

    reset -> the observation, rendered as the prompt (the model's chat template as one user turn, where on)
    repeat up to env.max_turns: generate one turn (to <eos>) -> step(its text) -> append the observation's tokens

The model's tokens carry their behaviour logprobs and the policy version that sampled each (a swap mid-episode
shows between or inside turns); the environment's tokens are masked (``Episode.token_mask`` 0, logprob 0,
version -1). Its ``reward`` is the sum of the environment's per-turn rewards. The observation of the step that
ends the episode is not appended (nothing would read it). ``generator.max_tokens`` bounds the whole response
(model and environment tokens), ``model.max_seq_len`` the whole sequence, ``env.max_turn_tokens`` one turn (a
turn cut there is still sent as the action).

Outcomes (``finish_reason``; each counted in ``counts`` and as ``generator/env/<outcome>`` metrics):

* ``done``: the environment ended it; ``max_turns``: ``env.max_turns`` model turns without an end; ``length``:
  no room left for another model token (``generator.max_tokens`` or ``model.max_seq_len``): trained as they are;
* ``truncated``: an observation that does not fit what is left of ``model.max_seq_len`` / ``generator.max_tokens``
  ends the episode before it (trained as it is, with the rewards so far);
* ``rejected``: the environment refused the model's action (``ActionRejected``): the episode ends with
  ``env.penalty`` added to its reward (trained: the policy learns to act validly);
* a replica lost mid-episode (``ReplicaLost``, or ``NoReplica`` for a session) restarts the episode from
  ``reset()`` on another replica, at most ``env.max_restarts`` times (``Episode.env_restarts``); beyond that
  the episode is dead-lettered with reason ``replica_lost``;
* a ``step`` or ``reset`` that raises (``EnvStepFailed``) or runs past ``env.step_timeout_s`` (``EnvTimeout``), or
  a first observation too long for a prompt: dead-lettered (``env_step_failed``, ``env_timeout``,
  ``observation_too_long``) with the detail.

A dead-lettered episode leaves its group short: the buffer drops the group as incomplete after its timeout. A
group whose every episode was dead-lettered (an environment that refused every reset: ``env_step_failed``) leaves
the prompt with no Episode: ``producers.pipeline.record_unanswered`` records it on ``unanswered`` before the offset
is committed. Every Episode names where its prompt was read (``origin``, as in the single-turn pipeline). None
of these stops the generator. Spans: ``generator.prompt`` > ``generator.episode`` (episode id, restarts,
outcome) > the router's ``env.reset`` / ``env.step`` (replica, turn) and ``generator.produce``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from envs.api import ActionRejected, EnvError, EnvRouter, EnvSession, NoReplica, ReplicaLost
from envs.config import EnvConfig
from producers.engine import Engine, Sampling
from producers.pipeline import Origin, record_unanswered
from runtime.metrics import record_metric
from topics.kafka import DeadLetters, Producer
from topics.names import Names
from topics.schemas import Episode, Prompt

_tracer = trace.get_tracer("streamforge.generator")
_CHARS_PER_TOKEN_BOUND = 64  # an observation longer than this many characters per token left is not tokenized


class TurnRenderer:
    """The token ids of the first observation (the prompt) and of every later one (environment tokens). Without a
    chat template: the text as it is (the prompt with the tokenizer's special tokens, later ones without). With
    one: the first observation is one user turn and the generation prompt (as ``PromptChecker.render``); a later
    one is what the template writes after an assistant turn for a user turn with that text and the next
    generation prompt (the difference of two renderings)."""

    def __init__(self, tokenizer: Any, *, chat_template: bool = False, system_prompt: str = "") -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def _chat(self, turns: list[dict[str, str]], *, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(self.system + turns, add_generation_prompt=generation,
                                                  tokenize=False)

    def _ids(self, text: str, *, special: bool) -> list[int]:
        return [int(t) for t in self.tokenizer(text, add_special_tokens=special)["input_ids"]]

    def first(self, text: str) -> list[int]:
        if not self.chat_template:
            return self._ids(text, special=True)
        return self._ids(self._chat([{"role": "user", "content": text}], generation=True), special=False)

    def observation(self, text: str) -> list[int]:
        if not self.chat_template:
            return self._ids(text, special=False)
        before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        head = self._chat(before, generation=False)
        full = self._chat([*before, {"role": "user", "content": text}], generation=True)
        return self._ids(full.removeprefix(head), special=False)


@dataclass(slots=True)
class _Failed:
    """An episode that produced no trainable Episode: dead-lettered with ``reason``."""

    reason: str
    detail: str
    restarts: int = 0


@dataclass(slots=True)
class _Play:
    """One attempt's growing response."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tool_calls: int = 0
    generate_s: float = 0.0

    def add(self, tokens: list[int], turn: int, *, logprobs: list[float] | None = None,
            versions: list[int] | None = None) -> None:
        model = logprobs is not None
        self.tokens += tokens
        self.mask += [int(model)] * len(tokens)
        self.turn_ids += [turn] * len(tokens)
        self.logprobs += logprobs if model else [0.0] * len(tokens)
        self.versions += versions if versions is not None else [-1] * len(tokens)


class MultiTurnPipeline:
    """See the module docstring. ``counts`` holds the outcomes and restarts (``stats`` is the role's counters)."""

    def __init__(self, *, engine: Engine, router: EnvRouter, env: EnvConfig, renderer: TurnRenderer,
                 producer: Producer, dead: DeadLetters, names: Names, generator_id: str, sampling: Sampling,
                 group_size: int, max_seq_len: int, stats: dict[str, int],
                 on_scored: Callable[[list[float]], None] | None = None,
                 on_produced: Callable[[str], None] | None = None) -> None:
        self.engine, self.router, self.env, self.renderer = engine, router, env, renderer
        self.producer, self.dead, self.names = producer, dead, names
        self.generator_id, self.sampling, self.group_size = generator_id, sampling, group_size
        self.max_seq_len, self.stats = max_seq_len, stats
        self.on_scored, self.on_produced = on_scored, on_produced
        self.counts: Counter[str] = Counter()

    async def run(self, prompt: Prompt, tokens: list[int], ctx: Any, origin: Origin | None = None) -> None:
        """Play, then produce, one group; returns once every Episode is acknowledged (or dead-lettered, and then,
        with none left, the prompt recorded unanswered)."""
        t_taken = time.time()
        with _tracer.start_as_current_span("generator.prompt", context=ctx, attributes={
                "prompt_id": prompt.prompt_id, "generator_id": self.generator_id, "group_size": self.group_size,
                "env": self.env.name}):
            results = await asyncio.gather(*(self._episode(prompt, i) for i in range(self.group_size)))
            episodes = [r for r in results if isinstance(r, Episode)]
            if origin is not None:
                for ep in episodes:
                    ep.prompt_partition, ep.prompt_offset = origin
            if self.on_scored is not None:
                self.on_scored([ep.reward for ep in episodes])
            acks = []
            for i, res in enumerate(results):
                if isinstance(res, _Failed):
                    await self._dead_letter(prompt, i, res, origin)
                    continue
                with _tracer.start_as_current_span("generator.produce", attributes={"episode_id": res.episode_id}):
                    acks.append(await self.producer.enqueue(self.names.episodes, res, key=res.group_id))
            if acks:
                await asyncio.gather(*acks)
                if self.on_produced is not None:
                    self.on_produced(prompt.prompt_id)
            else:  # every episode failed: say so before the offset is committed
                await record_unanswered(self.producer, self.names, prompt, origin,
                                        [(r.reason, r.detail) for r in results if isinstance(r, _Failed)],
                                        generator_id=self.generator_id)
            self.stats["prompts"] += 1
            self.stats["episodes"] += len(acks)
            self.stats["tokens"] += sum(int(ep.model_mask.sum()) for ep in episodes)
            record_metric("generator/queue_wait_s", max(0.0, t_taken - prompt.created_at))
            for ep in episodes:
                record_metric("generator/reward_mean", ep.reward)
                record_metric("generator/response_tokens", len(ep.response_tokens))
                record_metric("generator/env/turns", ep.turns)
                record_metric("generator/env/tool_calls", ep.tool_calls)
            for outcome, n in self.counts.items():
                record_metric(f"generator/env/{outcome}", n, "max")

    # -- one episode ---------------------------------------------------------------------------------------------
    async def _episode(self, prompt: Prompt, index: int) -> Episode | _Failed:
        """Attempts until one ends (restarting on a lost replica, at most ``env.max_restarts`` times)."""
        episode_id = f"{prompt.prompt_id}/{index}"
        seed = prompt.metadata.get("seed")
        seed = int(seed) if isinstance(seed, int) else None
        restarts, exclude = 0, ()
        with _tracer.start_as_current_span("generator.episode", attributes={"episode_id": episode_id}) as span:
            while True:
                try:
                    out = await self._attempt(prompt, index, seed, restarts, exclude)
                except (ReplicaLost, NoReplica) as exc:
                    if restarts >= self.env.max_restarts:
                        self.counts["replica_lost"] += 1
                        span.set_status(Status(StatusCode.ERROR, str(exc)))
                        return _Failed("replica_lost", f"{exc} (after {restarts} restarts)", restarts)
                    restarts += 1
                    self.counts["restarts"] += 1
                    exclude = (exc.replica_id,) if exc.replica_id else ()
                    span.add_event("restart", {"replica": exc.replica_id, "reason": exc.reason})
                    continue
                except EnvError as exc:  # EnvStepFailed, EnvTimeout: not the model's doing, nothing to train
                    self.counts[exc.reason] += 1
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    return _Failed(exc.reason, str(exc), restarts)
                span.set_attribute("restarts", restarts)
                span.set_attribute("outcome", out.finish_reason if isinstance(out, Episode) else out.reason)
                return out

    async def _attempt(self, prompt: Prompt, index: int, seed: int | None, restarts: int,
                       exclude: tuple[str, ...]) -> Episode | _Failed:
        session = await self.router.open(self.env.name, exclude=exclude)
        try:
            return await self._play(session, prompt, index, seed, restarts)
        finally:
            await session.close()

    async def _play(self, session: EnvSession, prompt: Prompt, index: int, seed: int | None,
                    restarts: int) -> Episode | _Failed:
        episode_id = f"{prompt.prompt_id}/{index}"
        t0 = time.monotonic()
        obs = await session.reset(seed=seed, episode_id=episode_id)
        budget = min(self.sampling.max_tokens, self.max_seq_len - 1)
        if len(obs.text) > _CHARS_PER_TOKEN_BOUND * self.max_seq_len:
            prompt_tokens: list[int] = []
        else:
            prompt_tokens = self.renderer.first(obs.text)
        if not prompt_tokens or len(prompt_tokens) >= self.max_seq_len - 1:
            self.counts["observation_too_long"] += 1
            return _Failed("observation_too_long", f"the first observation ({len(obs.text)} characters) does not "
                                                   f"fit model.max_seq_len {self.max_seq_len}", restarts)
        room_total = min(budget, self.max_seq_len - len(prompt_tokens))
        play, finish, penalty = _Play(), "max_turns", 0.0
        for turn in range(self.env.max_turns):
            room = room_total - len(play.tokens)
            if room < 1:
                finish = "length"
                break
            sampling = replace(self.sampling, max_tokens=min(room, self.env.max_turn_tokens or room))
            [c] = await self.engine.generate(
                prompt_tokens + play.tokens, 1, sampling,
                request_id=f"{self.generator_id}:{episode_id}:{restarts}:{turn}")
            play.add(list(c.token_ids), turn, logprobs=list(c.logprobs), versions=list(c.versions))
            play.text.append(c.text)
            play.generate_s += c.generate_s
            if c.finish_reason == "length" and len(play.tokens) >= room_total:
                finish = "length"  # cut mid-action: nothing to send
                break
            try:
                obs = await session.step(c.text.strip())
            except ActionRejected as exc:
                finish, penalty = "rejected", self.env.penalty
                play.text.append(f"[rejected: {exc}]")
                break
            play.turn_rewards.append(float(obs.reward or 0.0))
            play.tool_calls += int(bool(obs.info.get("tool_call")))
            if obs.done:
                finish = "done"
                break
            left = room_total - len(play.tokens)
            env_tokens = [] if len(obs.text) > _CHARS_PER_TOKEN_BOUND * max(left, 1) else \
                self.renderer.observation(obs.text)
            if len(env_tokens) >= left or (obs.text and not env_tokens):
                finish = "truncated"
                break
            play.add(env_tokens, turn)
            play.text.append(obs.text)
        self.counts[finish] += 1
        return self._episode_of(prompt, index, prompt_tokens, play, finish=finish, penalty=penalty,
                                replica=session.replica_id, restarts=restarts, seconds=time.monotonic() - t0)

    def _episode_of(self, prompt: Prompt, index: int, prompt_tokens: list[int], play: _Play, *, finish: str,
                    penalty: float, replica: str, restarts: int, seconds: float) -> Episode:
        versions = np.asarray(play.versions, dtype=np.int32)
        model_versions = versions[versions >= 0]
        turn_rewards = np.asarray(play.turn_rewards, dtype=np.float32)
        ep = Episode(
            episode_id=f"{prompt.prompt_id}/{index}", group_id=prompt.prompt_id, group_size=self.group_size,
            prompt_id=prompt.prompt_id, task=prompt.task,
            prompt_tokens=np.asarray(prompt_tokens, dtype=np.int32),
            response_tokens=np.asarray(play.tokens, dtype=np.int32),
            logprobs=np.asarray(play.logprobs, dtype=np.float32), token_versions=versions,
            policy_version=int(model_versions[0]) if len(model_versions) else self.engine.version,
            reward=float(turn_rewards.sum()) + penalty, finish_reason=finish, generator_id=self.generator_id,
            prompt_text=prompt.text, response_text="".join(play.text),
            timings={"generate_s": play.generate_s, "episode_s": seconds},
            token_mask=np.asarray(play.mask, dtype=np.uint8), turn_ids=np.asarray(play.turn_ids, dtype=np.int32),
            env_name=self.env.name, env_replica=replica, turn_rewards=turn_rewards,
            final_reward=float(turn_rewards[-1]) if len(turn_rewards) else 0.0, env_restarts=restarts,
            tool_calls=play.tool_calls)
        ep.validate()
        return ep

    async def _dead_letter(self, prompt: Prompt, index: int, failed: _Failed, origin: Origin | None) -> None:
        """An episode that could not be played: an empty Episode naming it, dead-lettered with the reason."""
        partition, offset = origin if origin is not None else (-1, -1)
        ep = Episode(episode_id=f"{prompt.prompt_id}/{index}", group_id=prompt.prompt_id,
                     group_size=self.group_size, prompt_id=prompt.prompt_id, task=prompt.task,
                     prompt_tokens=np.zeros(0, dtype=np.int32), response_tokens=np.zeros(0, dtype=np.int32),
                     logprobs=np.zeros(0, dtype=np.float32), token_versions=np.zeros(0, dtype=np.int32),
                     finish_reason=failed.reason, generator_id=self.generator_id, env_name=self.env.name,
                     env_restarts=failed.restarts, prompt_partition=partition, prompt_offset=offset)
        await self.dead.send_message(self.names.episodes, ep, reason=failed.reason, detail=failed.detail)
        self.stats["dead_lettered"] += 1
