"""The generator's per-prompt pipeline: generate one GRPO group, score it, produce its Episodes.

``PromptPipeline.run(prompt, tokens, ctx, origin)`` samples ``group_size`` responses (``group_id = prompt_id``,
``episode_id = f"{group_id}/{i}"``, deterministic), scores each with the configured rewards concurrently, and
produces the scored Episodes to the ``episodes`` topic keyed by ``group_id``, returning once the broker
acknowledged every one. ``origin`` is where the prompt was read on the ``prompts`` topic, ``(partition, offset)``
(None for a local source): every Episode carries it (``prompt_partition``, ``prompt_offset``). An Episode whose
reward raised or timed out goes to the dead-letter topic instead, with the reason; when that leaves the prompt
with no Episode at all, ``record_unanswered`` writes an ``UnansweredPrompt`` naming the prompt and the reasons to
the ``unanswered`` topic, acknowledged before ``run`` returns (so before the intake commits the prompt's offset:
the audit's ``prompts.unanswered_by_reason``). Spans: ``generator.prompt`` (child of the feeder's span through ``ctx``) with ``generator.generate``,
``generator.reward`` and ``generator.produce``; the Episodes' record headers carry the context on to the buffer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from producers.engine import Completion, Engine, Sampling
from producers.rewards import RewardFailed, RewardSet
from runtime.metrics import record_metric
from topics.kafka import DeadLetters, Producer
from topics.names import Names
from topics.schemas import Episode, Prompt, UnansweredPrompt

_tracer = trace.get_tracer("streamforge.generator")
log = logging.getLogger("streamforge.generator")

Origin = tuple[int, int]  # (partition, offset) of a prompt on the prompts topic


async def record_unanswered(producer: Producer, names: Names, prompt: Prompt, origin: Origin | None,
                            failures: Sequence[tuple[str, str]], *, generator_id: str) -> None:
    """The prompt's group has no Episode on the broker, every one dead-lettered for ``failures`` (``(reason,
    detail)`` each): write that as an ``UnansweredPrompt`` (reason: their one reason, else ``mixed``) and wait for
    the broker's acknowledgement. A prompt from a local source (``origin`` None) is not on the topic: nothing to
    write."""
    if origin is None:
        return
    reasons = Counter(reason for reason, _ in failures)
    reason = next(iter(reasons)) if len(reasons) == 1 else "mixed" if reasons else "no_episodes"
    record = UnansweredPrompt(prompt_id=prompt.prompt_id, partition=origin[0], offset=origin[1], reason=reason,
                              detail=failures[0][1] if failures else "", episode_reasons=dict(reasons),
                              generator_id=generator_id)
    log.warning("prompt %s (partition %d, offset %d) produced no episode: %s %s", prompt.prompt_id, origin[0],
                origin[1], reason, dict(reasons))
    await producer.send(names.unanswered, record, key=prompt.prompt_id)


def build_episodes(prompt: Prompt, prompt_tokens: list[int], completions: list[Completion], *, generator_id: str,
                   engine_version: int, queued_s: float, origin: Origin | None = None) -> list[Episode]:
    """One Episode per completion (rewards not yet filled in); ids are deterministic from the prompt id, and each
    names where the prompt was read (``origin``)."""
    partition, offset = origin if origin is not None else (-1, -1)
    out = []
    for c in completions:
        versions = np.asarray(c.versions, dtype=np.int32)
        out.append(Episode(
            episode_id=f"{prompt.prompt_id}/{c.index}", group_id=prompt.prompt_id, group_size=len(completions),
            prompt_id=prompt.prompt_id, task=prompt.task,
            prompt_tokens=np.asarray(prompt_tokens, dtype=np.int32),
            response_tokens=np.asarray(c.token_ids, dtype=np.int32),
            logprobs=np.asarray(c.logprobs, dtype=np.float32), token_versions=versions,
            policy_version=int(versions[0]) if len(versions) else engine_version,
            finish_reason=c.finish_reason, generator_id=generator_id, prompt_text=prompt.text,
            response_text=c.text,
            timings={"queued_s": queued_s, "first_token_s": c.first_token_s, "generate_s": c.generate_s},
            prompt_partition=partition, prompt_offset=offset,
        ))
    return out


class PromptPipeline:
    """Generate, score and produce one prompt's group. ``stats`` is the role's counters dict (updated here);
    ``on_scored(rewards)`` hears each group's rewards (the quota's refund of zero-variance groups),
    ``on_produced(group_id)`` each group on the broker (the refunds of groups the buffer drops)."""

    def __init__(self, *, engine: Engine, rewards: RewardSet, producer: Producer, dead: DeadLetters, names: Names,
                 generator_id: str, sampling: Sampling, group_size: int, stats: dict[str, int],
                 on_scored: Callable[[list[float]], None] | None = None,
                 on_produced: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.rewards = rewards
        self.producer = producer
        self.dead = dead
        self.names = names
        self.generator_id = generator_id
        self.sampling = sampling
        self.group_size = group_size
        self.stats = stats
        self.on_scored = on_scored
        self.on_produced = on_produced

    async def run(self, prompt: Prompt, tokens: list[int], ctx: Any, origin: Origin | None = None) -> None:
        """Generate from the prompt's ``tokens``, score and produce one group; returns once every Episode of it is
        acknowledged by the broker (or dead-lettered, and then, with none left, the prompt recorded unanswered)."""
        t_taken = time.time()
        with _tracer.start_as_current_span("generator.prompt", context=ctx, attributes={
                "prompt_id": prompt.prompt_id, "generator_id": self.generator_id, "group_size": self.group_size}):
            with _tracer.start_as_current_span("generator.generate") as span:
                completions = await self.engine.generate(tokens, self.group_size, self.sampling,
                                                         request_id=f"{self.generator_id}:{prompt.prompt_id}")
                span.set_attribute("tokens", sum(len(c.token_ids) for c in completions))
            episodes = build_episodes(prompt, tokens, completions, generator_id=self.generator_id,
                                      engine_version=self.engine.version,
                                      queued_s=max(0.0, t_taken - prompt.created_at), origin=origin)
            # score the whole group at once (rewards run in threads), then produce in index order
            failures: list[tuple[str, str]] = []
            scored = await self._score(prompt, episodes, failures)
            if self.on_scored is not None:
                self.on_scored([ep.reward for ep, ok in zip(episodes, scored) if ok])
            acks = []
            for ep, ok in zip(episodes, scored):
                if not ok:
                    continue
                with _tracer.start_as_current_span("generator.produce", attributes={"episode_id": ep.episode_id}):
                    acks.append(await self.producer.enqueue(self.names.episodes, ep, key=ep.group_id))
            if acks:
                await asyncio.gather(*acks)  # every Episode acknowledged by the broker
                if self.on_produced is not None:
                    self.on_produced(prompt.prompt_id)
            else:  # every reward failed: say so before the offset is committed
                await record_unanswered(self.producer, self.names, prompt, origin, failures,
                                        generator_id=self.generator_id)
            self.stats["prompts"] += 1
            self.stats["episodes"] += len(acks)
            self.stats["tokens"] += sum(len(c.token_ids) for c in completions)
            record_metric("generator/queue_wait_s", max(0.0, t_taken - prompt.created_at))
            record_metric("generator/generate_s", max((c.generate_s for c in completions), default=0.0))
            for ep, ok in zip(episodes, scored):
                if ok:
                    record_metric("generator/reward_mean", ep.reward)
                    for name, value in ep.reward_components.items():  # each reward apart (format, correctness)
                        record_metric(f"generator/reward/{name}", value)
                    record_metric("generator/response_tokens", len(ep.response_tokens))

    async def _score(self, prompt: Prompt, episodes: list[Episode], failures: list[tuple[str, str]]) -> list[bool]:
        """Fill in every Episode's reward; dead-letter those whose reward failed (``RewardFailed``): False, and its
        ``(reason, detail)`` appended to ``failures``."""
        with _tracer.start_as_current_span("generator.reward", attributes={
                "episode.ids": [ep.episode_id for ep in episodes]}) as span:
            results = await self.rewards.score_group(prompt, [ep.response_text for ep in episodes])
            ok = []
            for ep, res in zip(episodes, results):
                if isinstance(res, RewardFailed):
                    span.set_status(Status(StatusCode.ERROR, str(res)))
                    await self.dead.send_message(self.names.episodes, ep, reason=res.reason, detail=str(res))
                    failures.append((res.reason, str(res)))
                    self.stats["dead_lettered"] += 1
                    ok.append(False)
                    continue
                ep.reward, ep.reward_components = res.reward, res.components
                ep.timings["reward_s"] = res.seconds
                ep.validate()
                ok.append(True)
        return ok
