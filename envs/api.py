"""The contract between the generator's multi-turn loop and an environment: sessions opened through a router.

A generator never talks to an environment directly. It asks an ``EnvRouter`` to ``open(env_name)`` a session;
the router picks a replica (least loaded, healthy) and the session stays on that replica until ``close()``
(sticky). ``reset`` starts an episode and ``step`` sends one model action (text); each returns an
``EnvObservation`` whose ``text`` the generator appends to the context as environment tokens (masked out of the
loss). A router may serve replicas over the network (OpenEnv servers found on NATS) or in this process (tests).

Errors are typed (``EnvError`` and subclasses, each with ``retriable``): a session whose replica is gone raises
``ReplicaLost`` (retriable: the generator restarts the episode from ``reset()`` on another replica, at most
``env.max_restarts`` times), ``NoReplica`` when none is healthy; an environment that raises on an action, runs past
its step timeout or rejects the action raises ``EnvStepFailed``, ``EnvTimeout`` or ``ActionRejected`` (not
retriable: the episode's outcome is decided by the generator's configured policy, never a crash).

Writing an environment for it: an OpenEnv ``Environment`` subclass whose Action model has a ``text: str`` field
(or exactly one ``str`` field), which receives the model's action, and whose Observation's ``text`` field (or
only ``str`` field) is what the model reads next; ``reward`` and ``done`` are OpenEnv's own fields, the other
fields arrive in ``EnvObservation.info``. An environment *rejects* an action (``ActionRejected``, the session
stays usable) by raising ``ActionRejected`` from ``step`` or from a validator of its Action model, or by an
Action model the text does not validate against (a ``Literal``, a pattern, a validator raising ``ValueError``);
any other exception from ``reset`` or ``step`` is ``EnvStepFailed``. The router also rejects, before sending, an
action longer than ``env.max_action_chars`` or one that is not valid Unicode. A session is used by one caller at
a time (one reset or step in flight); after an ``EnvTimeout`` it is closed, and every later call raises again.

``ServiceEnvRouter`` (``envs/routing.py``) is the router over replicas served by ``streamforge run env``
(``envs/serving.py``); a lost replica raises ``ReplicaLost`` as soon as its connection drops, and at most
``env.health_timeout_s`` after it was last heard from when it hangs.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from topics.errors import StreamforgeError


@dataclass(kw_only=True, slots=True)
class EnvObservation:
    """What an environment answers to ``reset`` or ``step``."""

    text: str  # what the model reads next (appended to the context as environment tokens)
    done: bool = False  # the episode is over
    reward: float | None = None  # this turn's reward, if the environment gives one
    info: dict[str, Any] = field(default_factory=dict)  # anything else the environment reports (JSON-able)


@runtime_checkable
class EnvSession(Protocol):
    """One episode's conversation with one replica (sticky)."""

    env_name: str
    replica_id: str

    async def reset(self, *, seed: int | None = None, episode_id: str | None = None,
                    options: dict[str, Any] | None = None) -> EnvObservation: ...

    async def step(self, action: str, *, timeout_s: float | None = None) -> EnvObservation: ...

    async def close(self) -> None: ...


@runtime_checkable
class EnvRouter(Protocol):
    """Opens sessions on the least-loaded healthy replica of an environment, skipping ``exclude``d replicas."""

    async def open(self, env_name: str, *, exclude: Collection[str] = ()) -> EnvSession: ...


class EnvError(StreamforgeError):
    """Base of the environment errors; ``env_name`` and ``replica_id`` say where it happened."""

    reason = "env_error"

    def __init__(self, message: str, *, env_name: str = "", replica_id: str = "",
                 retriable: bool | None = None) -> None:
        super().__init__(message, retriable=retriable)
        self.env_name = env_name
        self.replica_id = replica_id


class ReplicaLost(EnvError):
    """The session's replica died or stopped answering: restart the episode on another replica."""

    retriable = True
    reason = "replica_lost"


class NoReplica(EnvError):
    """No healthy replica of the environment is registered (yet)."""

    retriable = True
    reason = "no_replica"


class EnvStepFailed(EnvError):
    """The environment raised while handling a reset or an action."""

    retriable = False
    reason = "env_step_failed"


class EnvTimeout(EnvError):
    """A reset or step ran past its timeout (``env.step_timeout_s``)."""

    retriable = False
    reason = "env_timeout"


class ActionRejected(EnvError):
    """The environment refused the model's action as invalid (it could not be parsed or is not allowed)."""

    retriable = False
    reason = "action_rejected"
