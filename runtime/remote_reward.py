"""Rewards scored by a reward service's replicas: the ``remote:<service>`` reward and the batch's wire form.

``RemoteReward(service)`` is what ``remote:<service>`` in ``generator.rewards`` resolves to. Bound to a started
``ServiceDirectory`` (the generator binds it once connected to NATS), ``await score(prompt, texts)`` sends the
whole group as one ``RewardRequest`` with ``call_one`` (the least-loaded healthy replica; the next one if that one
is gone, full or draining) and returns one result per text: the score, or a ``RowFailure`` saying why the replica
has none for that row. Any failure of the call itself raises (``ServiceUnavailable``, ``ServiceCallFailed``,
``TimeoutExpired``); the generator's ``RewardSet`` turns every non-score into ``RewardFailed`` (dead letters).

The replica side (``services/reward_replica.py``) rebuilds each row's ``Prompt`` with ``prompts_of`` and calls the
served ``fn(prompt, response_text) -> float``, the signature of every streamforge reward.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.services import ServiceDirectory
from topics.errors import ConfigError
from topics.names import valid_service_name
from topics.schemas import Prompt, RewardReply, RewardRequest

REMOTE_PREFIX = "remote:"
TIMEOUT_PREFIX = "timeout: "  # a reply's row error for a row not scored in time (services/reward_replica.py)


def request_for(prompts: Sequence[Prompt], texts: Sequence[str]) -> RewardRequest:
    """One request scoring ``texts[i]`` as the response to ``prompts[i]``."""
    return RewardRequest(request_id=uuid.uuid4().hex, prompt_ids=[p.prompt_id for p in prompts],
                         tasks=[p.task for p in prompts], prompt_texts=[p.text for p in prompts],
                         answers=[p.answer for p in prompts], responses=list(texts),
                         metadata={p.prompt_id: p.metadata for p in prompts if p.metadata})


def prompts_of(request: RewardRequest) -> list[Prompt]:
    """The ``Prompt`` of each row of a request (its token ids are not sent: a reward reads text)."""
    return [Prompt(prompt_id=pid, task=task, text=text, answer=answer, metadata=dict(request.metadata.get(pid) or {}))
            for pid, task, text, answer in zip(request.prompt_ids, request.tasks, request.prompt_texts,
                                               request.answers)]


@dataclass(frozen=True, slots=True)
class RowFailure:
    """Why one row has no score: ``reason`` is a dead-letter reason (``reward_error`` or ``reward_timeout``)."""

    reason: str
    detail: str


class RemoteReward:
    """A reward served by the replicas of ``service`` (module docstring)."""

    def __init__(self, service: str) -> None:
        if not valid_service_name(service):
            raise ConfigError("generator.rewards", f"remote reward {service!r}: 1 to 64 letters, digits, '_' or '-'")
        self.service = service
        self.directory: ServiceDirectory | None = None

    @classmethod
    def from_spec(cls, spec: str) -> RemoteReward:
        return cls(spec.removeprefix(REMOTE_PREFIX))

    def bind(self, directory: ServiceDirectory) -> None:
        self.directory = directory

    async def score(self, prompt: Prompt, texts: Sequence[str], *, timeout_s: float) -> list[float | RowFailure]:
        """Each text's score, or why the replica has none for it."""
        if self.directory is None:
            raise RuntimeError(f"remote reward {self.service!r} is not bound to a service directory")
        reply: Any = await self.directory.call_one(self.service, request_for([prompt] * len(texts), texts),
                                                   timeout_s=timeout_s, expect=RewardReply)
        if len(reply.scores) != len(texts):
            raise ValueError(f"replica {reply.replica_id} returned {len(reply.scores)} scores for {len(texts)}")
        out: list[float | RowFailure] = []
        for score, error in zip(reply.scores.tolist(), reply.errors):
            if error:
                reason = "reward_timeout" if error.startswith(TIMEOUT_PREFIX) else "reward_error"
                out.append(RowFailure(reason, f"replica {reply.replica_id}: {error}"))
            elif not math.isfinite(score):
                out.append(RowFailure("reward_error", f"replica {reply.replica_id}: a non-finite score ({score})"))
            else:
                out.append(float(score))
        return out
