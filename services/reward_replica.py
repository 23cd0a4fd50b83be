"""``streamforge run reward``: one replica of a reward service, scoring batches of responses sent over NATS.

``RewardRole(cfg, ctx)`` loads ``reward.impl`` (``module:fn``, the reward signature ``fn(prompt, response_text) ->
float``) and registers in the service layer (``runtime/services.py``) under ``reward.name`` with a request
endpoint. Each ``RewardRequest`` (a GRPO group, from a generator's ``remote:<name>`` reward) is answered with a
``RewardReply``: ``fn`` runs on a pool of ``reward.workers`` threads, one call per row; a row that raises, returns
something that is not a finite number, or is not done ``reward.timeout_s`` after the request arrived gets an error
string instead of its score (the generator dead-letters that episode); the replica keeps serving. At most
``reward.capacity`` requests are served at once (beyond: a retriable ``overloaded`` fault, the caller tries another
replica); the beat reports the requests in flight as the load.

Loops: ``heartbeat`` (never returns). Drain: beat ``draining`` (callers route nothing new here) and finish the
requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from runtime.context import RoleContext
from runtime.lifecycle import Service
from runtime.plugins import load_object
from runtime.registration import RequestRefused, ServiceRegistration
from runtime.remote_reward import TIMEOUT_PREFIX, prompts_of
from runtime.services import default_replica_id
from services.config import RewardServiceConfig
from topics.deadlines import within
from topics.errors import ConfigError
from topics.nats import connect
from topics.schemas import RewardReply, RewardRequest

log = logging.getLogger("streamforge.reward")


class RewardRole(Service):
    """See the module docstring."""

    name = "reward"

    def __init__(self, cfg: RewardServiceConfig, ctx: RoleContext) -> None:
        super().__init__()
        if not cfg.name:
            raise ConfigError("reward.name", "name the reward service (generators call it as remote:<name>)")
        if not cfg.impl:
            raise ConfigError("reward.impl", "name the reward function: 'module:fn'")
        self.cfg, self.ctx = cfg, ctx
        self.fn = load_object(cfg.impl, config_key="reward.impl")
        self.replica_id = cfg.replica_id or default_replica_id(cfg.name)
        self.drain_timeout_s = ctx.drain_timeout_s
        self.nc: Any = None
        self.registration: ServiceRegistration | None = None
        self._pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="reward")
        self.counts = {"requests": 0, "rows": 0, "row_errors": 0}

    async def _start(self) -> None:
        try:
            self.nc = await connect(self.ctx.nats, name=f"reward-{self.replica_id}")
            self.registration = ServiceRegistration(
                self.nc, self.ctx.names, service=self.cfg.name, replica_id=self.replica_id, kind="reward",
                capacity=self.cfg.capacity, heartbeat_s=self.cfg.heartbeat_s,
                health_timeout_s=self.cfg.health_timeout_s, handler=self.score, meta={"impl": self.cfg.impl},
                timeout_s=self.ctx.nats.request_timeout_s)
            await self.registration.start()
        except BaseException:
            await self._stop()
            raise

    def loops(self) -> dict[str, Any]:
        assert self.registration is not None
        return {"heartbeat": self.registration.loop()}

    async def drain(self) -> None:
        assert self.registration is not None
        await self.registration.drain()

    async def _stop(self) -> None:
        if self.registration is not None:
            await self.registration.stop()
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await within(self.nc.drain(), self.ctx.nats.request_timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def score(self, request: Any) -> RewardReply:
        """Score every row of a ``RewardRequest`` (module docstring)."""
        if not isinstance(request, RewardRequest):
            raise RequestRefused("unknown_request", f"a reward service scores RewardRequest, not {type(request).__name__}")
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        rows = list(zip(prompts_of(request), request.responses))
        futures = [loop.run_in_executor(self._pool, self.fn, prompt, text) for prompt, text in rows]
        if futures:
            await asyncio.wait(futures, timeout=self.cfg.timeout_s)
        scores, errors = np.full(len(rows), np.nan), [""] * len(rows)
        for i, fut in enumerate(futures):
            if not fut.done():
                fut.cancel()
                errors[i] = f"{TIMEOUT_PREFIX}no score within {self.cfg.timeout_s} s"
            elif fut.exception() is not None:
                exc = fut.exception()
                errors[i] = f"{type(exc).__name__}: {exc}"[:500]
            else:
                try:
                    value = float(fut.result())
                except (TypeError, ValueError):
                    value = math.nan
                if math.isfinite(value):
                    scores[i] = value
                else:
                    errors[i] = f"not a finite number: {fut.result()!r}"[:500]
        self.counts["requests"] += 1
        self.counts["rows"] += len(rows)
        self.counts["row_errors"] += sum(1 for e in errors if e)
        return RewardReply(request_id=request.request_id, scores=scores, errors=errors, replica_id=self.replica_id,
                           seconds=time.perf_counter() - t0)
