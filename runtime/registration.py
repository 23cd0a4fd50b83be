"""A replica's side of the service layer: its beats in the services bucket and its request endpoint.

``ServiceRegistration`` is what a replica role (``services/``) holds: the beats that make callers route to it and,
with a ``handler``, the NATS subject where it takes requests. The bucket, its keys and the callers' side are in
``runtime/services.py`` (its docstring states the health rules both sides follow).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS

from runtime.services import DRAINING, SERVING, open_bucket, service_key
from topics import codec
from topics.deadlines import within
from topics.errors import CodecError
from topics.names import Names, valid_replica_id, valid_service_name
from topics.refusals import guarded, subscribe_checked
from topics.schemas import ServiceBeat, ServiceFault

log = logging.getLogger("streamforge.services")

# a replica's request handler: a decoded schema message in, a schema message out (raise to answer a ServiceFault)
Handler = Callable[[Any], Awaitable[Any]]


class RequestRefused(Exception):
    """Raised by a replica's handler to answer a ``ServiceFault`` with its own ``code`` (e.g. unknown_request)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


class ServiceRegistration:
    """One replica's registration: its beats, and (with a ``handler``) its request endpoint.

    ``start()`` opens the bucket, subscribes the endpoint and writes the first beat; ``loop()`` (supervised by the
    replica's role) beats every ``heartbeat_s`` until cancelled and never returns by itself (a failed write is logged
    and the next beat tries again: NATS may come back); ``drain()`` beats ``state = draining`` (callers stop routing
    to it) and answers new requests with a retriable ``draining`` fault; ``stop()`` unsubscribes and deletes the
    key. Requests are served concurrently, at most ``capacity`` at once (beyond: a retriable ``overloaded`` fault);
    ``load()`` is what the beat reports (default: the requests in flight)."""

    def __init__(self, nc: NATS, names: Names, *, service: str, replica_id: str, kind: str, capacity: int,
                 heartbeat_s: float, health_timeout_s: float, address: str = "",
                 load: Callable[[], int] | None = None, meta: dict[str, Any] | None = None,
                 handler: Handler | None = None, timeout_s: float = 5.0) -> None:
        if not valid_service_name(service):
            raise ValueError(f"service name {service!r}: letters, digits, '_' or '-' only")
        if not valid_replica_id(replica_id):
            raise ValueError(f"replica id {replica_id!r}: letters, digits, '_' or '-' only")
        self.nc, self.names = nc, names
        self.service, self.replica_id, self.kind = service, replica_id, kind
        self.capacity, self.heartbeat_s, self.health_timeout_s = capacity, heartbeat_s, health_timeout_s
        self.handler = handler
        self.address = address or (names.service_subject(service, replica_id) if handler is not None else "")
        self._load = load
        self.meta = dict(meta or {})
        self.timeout_s = timeout_s
        self.state = SERVING
        self.in_flight = 0
        self.counts = {"requests": 0, "faults": 0, "beats": 0, "beat_failures": 0}
        self._seq = 0
        self._started_at = time.time()
        self._kv: Any = None
        self._sub: Any = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def key(self) -> str:
        return service_key(self.service, self.replica_id)

    @property
    def subject(self) -> str:
        """Where this replica's beats (and its key's deletion) are written: its key's subject in the bucket."""
        return f"$KV.{self.names.services_bucket}.{self.key}"

    @property
    def load(self) -> int:
        return int(self._load()) if self._load is not None else self.in_flight

    async def start(self) -> None:
        if self._kv is not None:
            return
        kv = await open_bucket(self.nc, self.names, timeout_s=self.timeout_s)
        if self.handler is not None and self._sub is None:  # flushed: a user that may not serve here is refused now
            self._sub = await subscribe_checked(self.nc, self.address, cb=self._on_request, timeout_s=self.timeout_s)
        await self.beat()
        self._kv = kv  # registered: stop() deletes the key
        log.info("service %s: replica %s registered at %s (capacity %d)", self.service, self.replica_id,
                 self.address, self.capacity)

    def beat_message(self) -> ServiceBeat:
        return ServiceBeat(service=self.service, replica_id=self.replica_id, kind=self.kind, address=self.address,
                           capacity=self.capacity, load=self.load, state=self.state, heartbeat_s=self.heartbeat_s,
                           health_timeout_s=self.health_timeout_s, seq=self._seq, host=socket.gethostname(),
                           pid=os.getpid(), started_at=self._started_at, meta=self.meta)

    async def beat(self) -> None:
        """Write one beat with its TTL (the server forgets this replica if no newer beat replaces it in time)."""
        self._seq += 1
        js = self.nc.jetstream(timeout=self.timeout_s)
        await guarded(self.nc, [self.subject], js.publish(self.subject, codec.encode(self.beat_message()),
                                                          msg_ttl=max(1, math.ceil(self.health_timeout_s))))
        self.counts["beats"] += 1

    async def loop(self) -> None:
        """Beat every ``heartbeat_s``; runs until cancelled. Waits on the timer only; a failed beat is retried at
        the next tick (this replica is out of routing meanwhile, which is right: callers cannot see it)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.beat()
            except Exception as exc:  # noqa: BLE001 - NATS down or slow: beat again next time
                self.counts["beat_failures"] += 1
                log.warning("service %s: beat of %s failed: %s", self.service, self.replica_id, exc)

    async def drain(self) -> None:
        """Tell callers to route nothing new here (one beat now), refuse new requests, let those in flight end."""
        if self.state == DRAINING:
            return
        self.state = DRAINING
        with contextlib.suppress(Exception):
            await self.beat()
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def stop(self) -> None:
        """Unsubscribe and delete the key (callers drop this replica at once). Idempotent; never raises."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        for task in list(self._tasks):
            task.cancel()
        if self._kv is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await within(guarded(self.nc, [self.subject], self._kv.delete(self.key)), self.timeout_s)
        self._kv = None

    async def _on_request(self, msg: Any) -> None:
        if not msg.reply:
            return  # a publish, not a request: nobody waits for an answer
        self.counts["requests"] += 1
        if self.state != SERVING:
            await self._fault(msg, "draining", "the replica is stopping", retriable=True)
            return
        if self.in_flight >= self.capacity:
            await self._fault(msg, "overloaded", f"{self.in_flight} requests in flight (capacity {self.capacity})",
                              retriable=True)
            return
        self.in_flight += 1
        task = asyncio.ensure_future(self._serve(msg))  # concurrently: nats-py runs one callback at a time
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, msg: Any) -> None:
        try:
            try:
                request = codec.decode(msg.data)
            except CodecError as exc:
                await self._fault(msg, exc.reason, str(exc))
                return
            assert self.handler is not None
            try:
                reply = await self.handler(request)
            except RequestRefused as exc:
                await self._fault(msg, exc.code, str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - the caller gets the reason; the replica keeps serving
                log.warning("service %s: request failed on %s: %s: %s", self.service, self.replica_id,
                            type(exc).__name__, exc)
                await self._fault(msg, "handler_error", f"{type(exc).__name__}: {exc}")
                return
            with contextlib.suppress(Exception):
                await msg.respond(codec.encode(reply))
        finally:
            self.in_flight -= 1

    async def _fault(self, msg: Any, code: str, detail: str, *, retriable: bool = False) -> None:
        self.counts["faults"] += 1
        fault = ServiceFault(code=code, detail=detail[:2000], replica_id=self.replica_id, retriable=retriable)
        with contextlib.suppress(Exception):
            await msg.respond(codec.encode(fault))
