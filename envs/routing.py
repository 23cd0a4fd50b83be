"""The calling side of environment replicas: ``ServiceEnvRouter`` opens sticky WebSocket sessions found on NATS.

``ServiceEnvRouter(directory, cfg)`` implements ``envs.api.EnvRouter`` over the service layer
(``runtime/services.py``): ``open(env_name)`` picks the least-loaded healthy replica registered under
``env_name``, connects to its OpenEnv WebSocket (``<address>/ws``: one environment instance per connection, so
every reset and step of the session reaches that replica and that instance), and returns a ``RemoteEnvSession``.
While no replica has room (none registered yet, all at ``capacity``) it waits up to ``env.step_timeout_s``; a
replica that refuses the connection is marked lost and the next one is tried; none left: ``NoReplica``.

The session speaks OpenEnv's WebSocket protocol itself (JSON ``{"type": "reset"|"step"|"close", "data": ...}``,
answers ``observation`` or ``error``): a reset sends ``{seed, episode_id, **options}``; a step sends
``{<action_field>: action}`` (the replica's beat names the field); the observation's text is its
``observation_field`` (the rest of its fields go to ``info``). Outcomes, each counted in ``router.counts``:

* the connection drops (the replica died: its kernel closed the socket) -> ``ReplicaLost`` at once;
* the replica stops answering (hung, partitioned): WebSocket pings every ``env.heartbeat_s`` close the connection
  when a pong is ``env.health_timeout_s - env.heartbeat_s`` late, so ``ReplicaLost`` comes at most
  ``env.health_timeout_s`` after the replica was last heard from; a lost replica is also marked lost in the
  directory, so the next ``open`` goes to another one;
* no answer within ``timeout_s`` (default ``env.step_timeout_s``) -> ``EnvTimeout``; the session is closed (a late
  answer must not be taken for the next one), every later call raises ``EnvTimeout`` again;
* an execution error whose message starts ``action_rejected:`` (``envs/serving.py``), a validation error of a
  step, an action longer than ``env.max_action_chars`` or not encodable as UTF-8 (lone surrogates; both refused
  before sending) -> ``ActionRejected``; the session stays usable;
* any other error the environment raised -> ``EnvStepFailed`` (the session stays usable unless the replica closed
  it, which then shows as ``ReplicaLost`` at the next call); a replica at its capacity -> ``NoReplica``.

Spans ``env.reset`` and ``env.step`` (attributes: env, replica, turn, outcome) join the caller's current trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Collection
from typing import Any

import orjson
from opentelemetry import trace

from envs.api import ActionRejected, EnvError, EnvObservation, EnvStepFailed, EnvTimeout, NoReplica, ReplicaLost
from envs.config import EnvConfig
from runtime.services import Replica, ServiceDirectory, ServiceUnavailable
from topics.deadlines import within

log = logging.getLogger("streamforge.env.routing")
_tracer = trace.get_tracer("streamforge.env")

REJECTED_PREFIX = "action_rejected: "  # the replica's mark of a rejection (envs/serving.py)
MAX_MESSAGE_BYTES = 64 << 20  # the largest observation a session accepts


class ServiceEnvRouter:
    """``EnvRouter`` over replicas registered on NATS (module docstring). One per event loop; sessions share its
    ``directory`` (started by the caller) and ``counts``."""

    def __init__(self, directory: ServiceDirectory, cfg: EnvConfig | None = None) -> None:
        self.directory = directory
        self.cfg = cfg or EnvConfig()
        self.counts: Counter[str] = Counter()

    async def open(self, env_name: str, *, exclude: Collection[str] = ()) -> RemoteEnvSession:
        import websockets

        tried = set(exclude)
        cfg = self.cfg
        while True:
            try:  # a replica may be starting, or all full: wait for room as long as a step may take
                replica = await self.directory.wait_pick(env_name, exclude=tried, timeout_s=cfg.step_timeout_s)
            except ServiceUnavailable as exc:
                self.counts["no_replica"] += 1
                raise NoReplica(str(exc), env_name=env_name) from exc
            tried.add(replica.replica_id)
            # a silent replica is dropped at most health_timeout_s after its last pong: a ping every heartbeat_s,
            # then the pong's timeout, then the close (websockets waits close_timeout for the socket to end)
            close_s = 0.2 * cfg.heartbeat_s
            try:
                ws = await websockets.connect(
                    f"{replica.address}/ws", open_timeout=cfg.step_timeout_s, max_size=MAX_MESSAGE_BYTES,
                    ping_interval=cfg.heartbeat_s, ping_timeout=cfg.health_timeout_s - cfg.heartbeat_s - close_s,
                    close_timeout=close_s, compression=None)
            except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as exc:
                self.counts["connect_failed"] += 1
                self.directory.mark_lost(env_name, replica.replica_id)
                log.warning("env %s: replica %s at %s refused a session (%s); trying another", env_name,
                            replica.replica_id, replica.address, exc)
                continue
            self.counts["opened"] += 1
            return RemoteEnvSession(self, replica, ws)


class RemoteEnvSession:
    """One episode's sticky session with one replica (``envs.api.EnvSession``); module docstring for outcomes."""

    def __init__(self, router: ServiceEnvRouter, replica: Replica, ws: Any) -> None:
        self.router = router
        self.env_name = replica.beat.service
        self.replica_id = replica.replica_id
        self.action_field = str(replica.beat.meta.get("action_field") or "text")
        self.observation_field = str(replica.beat.meta.get("observation_field") or "")
        self.turn = 0
        self._ws = ws
        self._broken: EnvError | None = None
        self._closing: asyncio.Future | None = None

    @property
    def counts(self) -> Counter[str]:
        return self.router.counts

    async def reset(self, *, seed: int | None = None, episode_id: str | None = None,
                    options: dict[str, Any] | None = None) -> EnvObservation:
        data: dict[str, Any] = dict(options or {})
        if seed is not None:
            data["seed"] = seed
        if episode_id is not None:
            data["episode_id"] = episode_id
        self.turn = 0
        with _tracer.start_as_current_span("env.reset", attributes=self._attributes()) as span:
            obs = await self._call("reset", data, self.router.cfg.step_timeout_s, span)
        return obs

    async def step(self, action: str, *, timeout_s: float | None = None) -> EnvObservation:
        self.turn += 1
        with _tracer.start_as_current_span("env.step", attributes=self._attributes()) as span:
            reason = self._refusal(action)
            if reason:
                self.counts["rejected"] += 1
                span.set_attribute("outcome", "rejected")
                raise ActionRejected(reason, env_name=self.env_name, replica_id=self.replica_id)
            timeout = self.router.cfg.step_timeout_s if timeout_s is None else timeout_s
            return await self._call("step", {self.action_field: action}, timeout, span)

    async def close(self) -> None:
        """End the session (the replica frees its environment instance). Idempotent; never raises."""
        if self._ws is None:
            return
        ws, self._ws = self._ws, None
        with contextlib.suppress(Exception):
            await within(ws.send('{"type":"close"}'), 1.0)
        with contextlib.suppress(Exception):
            await within(ws.close(), 2.0)
        if self._broken is None:
            self._broken = EnvStepFailed("the session is closed", env_name=self.env_name, replica_id=self.replica_id)

    # -- internals ----------------------------------------------------------------------------------------------
    def _attributes(self) -> dict[str, Any]:
        return {"env": self.env_name, "replica": self.replica_id, "turn": self.turn}

    def _refusal(self, action: Any) -> str:
        if not isinstance(action, str):
            return f"an action is text, not {type(action).__name__}"
        if len(action) > self.router.cfg.max_action_chars:
            return f"oversized: {len(action)} characters (env.max_action_chars = {self.router.cfg.max_action_chars})"
        try:
            action.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"not valid unicode: {exc.reason} at {exc.start}"
        return ""

    def _error(self, cls: type[EnvError], message: str, outcome: str) -> EnvError:
        self.counts[outcome] += 1
        return cls(message, env_name=self.env_name, replica_id=self.replica_id)

    async def _call(self, kind: str, data: dict[str, Any], timeout_s: float, span: Any) -> EnvObservation:
        import websockets

        if self._broken is not None:
            span.set_attribute("outcome", "broken")
            raise type(self._broken)(str(self._broken), env_name=self.env_name, replica_id=self.replica_id)
        t0 = time.monotonic()
        try:
            await self._ws.send(orjson.dumps({"type": kind, "data": data}).decode())
            raw = await within(self._ws.recv(), timeout_s)
        except TimeoutError:
            err = self._error(EnvTimeout, f"{kind} took longer than {timeout_s} s", "timeout")
            self._broken = err
            self._closing = asyncio.ensure_future(self.close())  # best effort; close() never raises
            span.set_attribute("outcome", "timeout")
            raise err from None
        except (websockets.exceptions.ConnectionClosed, OSError) as exc:
            rcvd = getattr(exc, "rcvd", None)
            if getattr(exc, "sent", None) is not None and exc.sent.code == 1009:  # we refused a huge observation
                err = self._error(EnvStepFailed, f"observation larger than {MAX_MESSAGE_BYTES} bytes", "failed")
            else:
                self.router.directory.mark_lost(self.env_name, self.replica_id)
                how = f"closed ({rcvd.code} {rcvd.reason})" if rcvd is not None else f"lost ({exc})"
                err = self._error(ReplicaLost, f"the connection to replica {self.replica_id} {how} during {kind}",
                                  "lost")
            self._broken = err
            self._ws = None
            span.set_attribute("outcome", err.reason)
            raise err from None
        span.set_attribute("seconds", time.monotonic() - t0)
        return self._answer(kind, raw, span)

    def _answer(self, kind: str, raw: str | bytes, span: Any) -> EnvObservation:
        try:
            msg = orjson.loads(raw)
            body = msg["data"]
            if msg["type"] == "observation":
                obs = self._observation(body)
                self.counts[kind] += 1
                span.set_attribute("outcome", "ok")
                span.set_attribute("done", obs.done)
                return obs
            if msg["type"] != "error":
                raise ValueError(f"unexpected answer type {msg['type']!r}")
            code, message = str(body.get("code", "")), str(body.get("message", ""))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            span.set_attribute("outcome", "failed")
            raise self._error(EnvStepFailed, f"unreadable answer to {kind}: {exc}", "failed") from None
        if code == "EXECUTION_ERROR" and message.startswith(REJECTED_PREFIX):
            err = self._error(ActionRejected, message[len(REJECTED_PREFIX):], "rejected")
        elif code == "VALIDATION_ERROR" and kind == "step":
            err = self._error(ActionRejected, message, "rejected")
        elif code == "CAPACITY_REACHED":
            err = self._error(NoReplica, f"replica {self.replica_id} is full: {message}", "no_replica")
        else:
            err = self._error(EnvStepFailed, f"{code}: {message}", "failed")
        if code in ("CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR"):  # the replica closes the session
            self._broken = err
        span.set_attribute("outcome", err.reason)
        raise err

    def _observation(self, body: dict[str, Any]) -> EnvObservation:
        fields = dict(body.get("observation") or {})
        text = fields.pop(self.observation_field, None) if self.observation_field else None
        if not isinstance(text, str):
            text = orjson.dumps(fields).decode() if fields else ""
        reward = body.get("reward")
        return EnvObservation(text=text, done=bool(body.get("done", False)),
                              reward=None if reward is None else float(reward), info=fields)
