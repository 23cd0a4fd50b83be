"""``streamforge run env``: one replica of an environment, an OpenEnv server registered on NATS.

``EnvRole(cfg, ctx)`` serves the environment ``env.impl`` (``envs/serving.py``: OpenEnv's ``create_app`` under
uvicorn, on ``env.host:env.port``) and registers it in the service layer (``runtime/services.py``) under
``env.name`` as replica ``env.replica_id`` (default ``<name>-<hostname>-<pid>``): its address ``ws://host:port``,
``env.capacity`` and its live session count, beating every ``env.heartbeat_s``. Generators route episodes to it
(``envs/routing.py``). A bad ``env.impl`` fails when the role is built, naming the key.

Loops: ``server`` (uvicorn; returning is a crash), ``heartbeat`` (never returns), ``metrics`` (every 10 s: live
sessions and what they sent). Drain (first SIGTERM): the replica beats ``draining`` so routers open nothing new
here, and waits for the live sessions to end (bounded by ``up.drain_timeout_s``); stop: the key is deleted, the
server closes whatever sessions remain (their callers see ``ReplicaLost`` and restart those episodes elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from envs.config import EnvConfig
from envs.serving import EnvServer
from runtime.context import RoleContext
from runtime.lifecycle import Service
from runtime.metrics import flush_metrics, record_metric
from runtime.registration import ServiceRegistration
from runtime.services import default_replica_id
from topics.deadlines import within
from topics.errors import ConfigError
from topics.nats import connect

log = logging.getLogger("streamforge.env")

METRICS_EVERY_S = 10.0


class EnvRole(Service):
    """See the module docstring."""

    name = "env"

    def __init__(self, cfg: EnvConfig, ctx: RoleContext) -> None:
        super().__init__()
        if not cfg.name:
            raise ConfigError("env.name", "name the environment service (generators route to it by this name)")
        self.cfg, self.ctx = cfg, ctx
        self.replica_id = cfg.replica_id or default_replica_id(cfg.name)
        self.drain_timeout_s = ctx.drain_timeout_s
        self.server = EnvServer(cfg, replica_id=self.replica_id)  # resolves env.impl now: a bad one fails here
        self.nc: Any = None
        self.registration: ServiceRegistration | None = None
        self._reports = 0

    async def _start(self) -> None:
        try:
            await self.server.start()
            self.nc = await connect(self.ctx.nats, name=f"env-{self.replica_id}")
            self.registration = ServiceRegistration(
                self.nc, self.ctx.names, service=self.cfg.name, replica_id=self.replica_id, kind="env",
                capacity=self.cfg.capacity, heartbeat_s=self.cfg.heartbeat_s,
                health_timeout_s=self.cfg.health_timeout_s, address=self.server.address,
                load=lambda: self.server.live_sessions, meta=self.server.meta,
                timeout_s=self.ctx.nats.request_timeout_s)
            await self.registration.start()
        except BaseException:
            await self._stop()
            raise

    def loops(self) -> dict[str, Any]:
        assert self.registration is not None
        return {"server": self.server.serve(), "heartbeat": self.registration.loop(), "metrics": self._metrics()}

    async def drain(self) -> None:
        """Route nothing new here; wait for the live sessions to end (``serve`` bounds it)."""
        assert self.registration is not None
        await self.registration.drain()
        await self.server.wait_idle()

    async def _stop(self) -> None:
        if self.registration is not None:
            await self.registration.stop()
        await self.server.stop()
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await within(self.nc.drain(), self.ctx.nats.request_timeout_s)
        self._report()

    async def _metrics(self) -> None:
        """Every ``METRICS_EVERY_S``: one metrics row. Never ends."""
        while True:
            await asyncio.sleep(METRICS_EVERY_S)
            self._report()

    def _report(self) -> None:
        sessions = self.server.sessions
        record_metric("env/sessions_live", sessions.live, "max")
        record_metric("env/sessions_opened", sessions.opened, "max")
        for kind, n in sessions.messages.items():
            record_metric(f"env/messages/{kind}", n, "max")
        self._reports += 1
        flush_metrics(self._reports)
