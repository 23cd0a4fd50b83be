"""Replicated services over NATS: replicas register and beat in a KV bucket; callers route to the least loaded.

A *service* is a name (an environment's ``env.name``, a reward's ``reward.name``) served by any number of
*replicas*. Each replica (``ServiceRegistration``, ``runtime/registration.py``) writes a ``ServiceBeat`` (its
address, capacity, load, state) to key ``<service>.<replica_id>`` of the JetStream KV bucket ``{prefix}_services``
every ``heartbeat_s``, each write with a per-message time-to-live of ``health_timeout_s`` rounded up to whole
seconds; it deletes the key when it stops. Callers (``ServiceDirectory``) watch the bucket and route:

* ``pick(service)``: the healthy replica with the lowest estimated load over capacity (ties at random), where the
  estimate is the others' load as of the replica's last beat plus this caller's own now (its requests in flight,
  the sessions it opened since that beat); a full replica is skipped. ``wait_pick`` waits (woken by beats and by
  this caller's answers) while none has room. Sticky sessions are the caller's: it keeps the replica it picked
  (``envs/routing.py``).
* ``call_one(service, msg)``: a request to the least-loaded replica with room, waiting for room while all are busy
  (a replica that answers ``overloaded`` is busy until its next beat) and going to another when one is gone or
  draining, all within the call's timeout; ``fanout(service, msg)``: the same request to every healthy replica.

Health: a replica is *healthy* while its last beat arrived at most ``health_timeout_s`` ago (the replica's own
setting, carried in its beat), it is not draining, and no caller found it dead since (``mark_lost``: it comes
back with a beat that arrives at least one heartbeat after). The check is made at every pick on this caller's
monotonic clock, so a replica that stops beating is out of routing ``health_timeout_s`` after its last beat
arrived, however the server's expiry timer runs; the TTL then removes its key (``streamforge status`` stops
listing it, and every watcher gets the delete marker) within ``health_timeout_s`` rounded up.

Why JetStream KV with a TTL and not ``nats.micro``: a micro service has no heartbeat and no pushed load. Its
discovery is a scatter-gather PING answered within a caller-chosen window, its metadata is fixed when it starts
(the load would come from STATS requests), so every caller would have to poll every replica to learn of a dead
one or a busy one. The bucket pushes each beat to every watcher as it is written, holds the current view for a
caller that starts late (the watch's initial values) and for ``streamforge status``, and the server itself
forgets a replica that stopped beating. Requests to a replica (``call_one``, ``fanout``) are plain NATS
request/reply on the subject the replica registered (``{prefix}.svc.<service>.<replica_id>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError

from topics import codec
from topics.deadlines import within
from topics.errors import CodecError, PermissionDenied, StreamforgeError, TimeoutExpired
from topics.names import Names
from topics.refusals import guarded
from topics.schemas import ServiceBeat, ServiceFault
from topics.tracing import nats_headers

log = logging.getLogger("streamforge.services")

MARKER_TTL_S = 60.0  # how long the bucket keeps the delete marker of an expired beat (watchers see it meanwhile)
SERVING, DRAINING = "serving", "draining"

class ServiceUnavailable(StreamforgeError):
    """No healthy replica of the service can take the call now (none registered, all full, all failed)."""

    retriable = True

    def __init__(self, service: str, detail: str) -> None:
        super().__init__(f"service {service!r}: {detail}")
        self.service = service


class ServiceCallFailed(StreamforgeError):
    """A replica answered a request with a ``ServiceFault``; ``code`` and ``replica_id`` say which and where."""

    def __init__(self, service: str, fault: ServiceFault) -> None:
        super().__init__(f"service {service!r} replica {fault.replica_id!r}: {fault.code}: {fault.detail}",
                         retriable=fault.retriable)
        self.service = service
        self.code = fault.code
        self.replica_id = fault.replica_id


async def open_bucket(nc: NATS, names: Names, *, timeout_s: float = 5.0, create: bool = True) -> Any:
    """The run's services bucket, created (history 1, per-message TTLs allowed) if it does not exist yet (``create``;
    else ``BucketNotFoundError``). A user whose NATS permissions refuse it gets ``PermissionDenied`` at once."""
    js = nc.jetstream(timeout=timeout_s)
    stream = f"KV_{names.services_bucket}"
    api = [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}", "$JS.API.INFO"]
    try:
        return await guarded(nc, api, js.key_value(names.services_bucket))
    except BucketNotFoundError:
        if not create:
            raise
    try:
        return await guarded(nc, api, js.create_key_value(KeyValueConfig(bucket=names.services_bucket, history=1,
                                                                         limit_marker_ttl=MARKER_TTL_S)))
    except PermissionDenied:
        raise
    except Exception:  # noqa: BLE001 - another process created it first: open theirs
        return await guarded(nc, api, js.key_value(names.services_bucket))


def service_key(service: str, replica_id: str) -> str:
    return f"{service}.{replica_id}"


def default_replica_id(service: str) -> str:
    """``<service>-<hostname>-<pid>``, with the hostname's dots made dashes (a replica id is part of subjects)."""
    from topics.names import safe_replica_id

    return safe_replica_id(f"{service}-{socket.gethostname()}-{os.getpid()}")


# -- the caller side -----------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Replica:
    """What a caller knows of one replica: its last beat and when it arrived (this caller's monotonic clock)."""

    beat: ServiceBeat
    seen_at: float
    opened_since_beat: int = 0  # sessions this caller opened on it since that beat (not in the beat's load yet)
    in_flight: int = 0  # requests of this caller it has not answered yet
    in_flight_at_beat: int = 0  # ... when its last beat arrived (the beat's load counts them)
    refused_since_beat: bool = False  # it answered this caller "overloaded" since its last beat
    lost_at: float | None = None  # when this caller found it dead (connection dropped, no answer)

    @property
    def replica_id(self) -> str:
        return self.beat.replica_id

    @property
    def address(self) -> str:
        return self.beat.address

    @property
    def estimated_load(self) -> int:
        """Others' load as of its last beat, plus this caller's now: its requests in flight and the sessions it
        opened since that beat."""
        return max(0, self.beat.load - self.in_flight_at_beat) + self.in_flight + self.opened_since_beat

    def age(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.seen_at

    def healthy(self, now: float | None = None) -> bool:
        return self.age(now) <= self.beat.health_timeout_s and self.lost_at is None

    def routable(self, now: float | None = None) -> bool:
        return (self.healthy(now) and self.beat.state == SERVING and not self.refused_since_beat
                and self.estimated_load < self.beat.capacity)


class ServiceDirectory:
    """A caller's live view of every service of a run (module docstring): routing, ``call_one`` and ``fanout``.

    ``start()`` opens the bucket, starts watching it and returns once the current beats are read. The watch runs
    as a task of its own (``loop()`` awaits it, for a role that supervises it); if it fails, every later pick
    raises its error. ``stop()`` ends it. Callers on one event loop share one directory."""

    def __init__(self, nc: NATS, names: Names, *, timeout_s: float = 5.0, create: bool = True) -> None:
        self.nc, self.names, self.timeout_s = nc, names, timeout_s
        self.create = create  # create the bucket if it does not exist (False: a read-only caller)
        self.replicas: dict[str, dict[str, Replica]] = {}
        self.counts = {"beats": 0, "undecodable": 0, "expired": 0, "lost": 0}
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._changed = asyncio.Condition()
        self._watcher: Any = None

    async def start(self) -> None:
        if self._task is not None:
            return
        kv = await open_bucket(self.nc, self.names, timeout_s=self.timeout_s, create=self.create)
        stream = f"KV_{self.names.services_bucket}"
        watch_api = [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
                     f"$JS.API.CONSUMER.INFO.{stream}.>"]
        self._watcher = await guarded(self.nc, watch_api, kv.watch(">"))
        self._task = asyncio.ensure_future(self._watch())
        ready = asyncio.ensure_future(self._ready.wait())
        await asyncio.wait([ready, self._task], timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if self._task.done():
            self._task.result()  # the watch failed at once: say why

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._watcher is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
        self._watcher = None

    async def loop(self) -> None:
        """Await the watch (for a role's supervision): returns or raises only if the watch ended."""
        assert self._task is not None, "start() first"
        await asyncio.shield(self._task)

    async def _watch(self) -> None:
        """Consumes the bucket's updates (initial values first, then every beat and delete as written); waits on
        the watcher; ends only when cancelled or when the watcher fails."""
        async for entry in self._watcher:
            if entry is None:  # the initial values are all read
                self._ready.set()
                continue
            service, _, replica_id = entry.key.partition(".")
            if entry.operation is not None or entry.value is None:  # deleted on stop, or expired by its TTL
                gone = self.replicas.get(service, {}).pop(replica_id, None)
                if gone is not None:
                    self.counts["expired"] += 1
                    log.info("service %s: replica %s left (%s)", service, replica_id, entry.operation)
            else:
                self._on_beat(service, replica_id, entry.value)
            async with self._changed:
                self._changed.notify_all()

    def _on_beat(self, service: str, replica_id: str, value: bytes) -> None:
        try:
            beat = codec.decode(value, expect=ServiceBeat)
        except CodecError as exc:
            self.counts["undecodable"] += 1
            log.warning("service %s: undecodable beat of %s: %s", service, replica_id, exc)
            return
        if beat.service != service or beat.replica_id != replica_id:
            self.counts["undecodable"] += 1
            log.warning("service beat under key %s.%s names %s.%s", service, replica_id, beat.service,
                        beat.replica_id)
            return
        self.counts["beats"] += 1
        now = time.monotonic()
        # a beat read with the initial values may be old: date it by the replica's clock (the TTL bounds it anyway)
        seen = now if self._ready.is_set() else now - max(0.0, time.time() - beat.created_at)
        known = self.replicas.setdefault(service, {}).get(replica_id)
        if known is None:
            self.replicas[service][replica_id] = Replica(beat, seen)
            log.info("service %s: replica %s at %s", service, replica_id, beat.address)
            return
        known.beat, known.seen_at, known.opened_since_beat = beat, seen, 0
        known.in_flight_at_beat, known.refused_since_beat = known.in_flight, False
        if known.lost_at is not None and now - known.lost_at >= beat.heartbeat_s:
            known.lost_at = None  # it beats again a heartbeat after it was found dead: it lives

    # -- routing ------------------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self._task is None:
            raise RuntimeError("ServiceDirectory.start() was not called")
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()  # type: ignore[misc]

    def healthy(self, service: str) -> list[Replica]:
        """The healthy replicas of ``service`` (draining ones included: they still serve what they hold)."""
        self._check()
        now = time.monotonic()
        return [r for r in self.replicas.get(service, {}).values() if r.healthy(now)]

    def get(self, service: str, replica_id: str) -> Replica | None:
        return self.replicas.get(service, {}).get(replica_id)

    def pick(self, service: str, *, exclude: Collection[str] = (), hold: bool = True) -> Replica:
        """The routable replica of ``service`` with the lowest estimated load over capacity (ties at random);
        ``hold``: a session opens on it (one more unit of load until its next beat). ``ServiceUnavailable`` if
        there is none."""
        self._check()
        now = time.monotonic()
        known = self.replicas.get(service, {})
        options = [r for r in known.values() if r.replica_id not in exclude and r.routable(now)]
        if not options:
            healthy = sum(r.healthy(now) for r in known.values())
            raise ServiceUnavailable(service, f"no replica can take it ({len(known)} registered, {healthy} healthy, "
                                              f"{len(exclude)} excluded, the rest draining or full)")
        best = min(r.estimated_load / r.beat.capacity for r in options)
        choice = random.choice([r for r in options if r.estimated_load / r.beat.capacity == best])
        choice.opened_since_beat += int(hold)
        return choice

    async def wait_pick(self, service: str, *, timeout_s: float, exclude: Collection[str] = (),
                        hold: bool = True) -> Replica:
        """``pick``, waiting while no replica can take it (none registered yet, all full or busy): woken by every
        beat and every answer this caller gets; ``ServiceUnavailable`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.pick(service, exclude=exclude, hold=hold)
            except ServiceUnavailable:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        await within(self._changed.wait(), left)

    def mark_lost(self, service: str, replica_id: str) -> None:
        """This caller found the replica dead: route nothing to it until it beats again a heartbeat later."""
        replica = self.get(service, replica_id)
        if replica is not None and replica.lost_at is None:
            replica.lost_at = time.monotonic()
            self.counts["lost"] += 1
            log.warning("service %s: replica %s lost", service, replica_id)

    async def wait_for(self, service: str, count: int = 1, *, timeout_s: float) -> list[Replica]:
        """Wait until ``service`` has ``count`` healthy replicas (woken by each beat); ``TimeoutExpired`` if not."""
        self._check()

        async def enough() -> list[Replica]:
            async with self._changed:
                await self._changed.wait_for(lambda: len(self.healthy(service)) >= count)
            return self.healthy(service)

        try:
            return await within(enough(), timeout_s)
        except TimeoutError:
            raise TimeoutExpired(f"service {service!r}: {len(self.healthy(service))} of {count} replicas healthy "
                                 f"after {timeout_s} s") from None

    # -- request/reply ------------------------------------------------------------------------------------------
    async def request(self, replica: Replica, msg: Any, *, timeout_s: float, expect: type | None = None) -> Any:
        """One request to one replica: its reply, ``ServiceCallFailed`` for its fault, ``TimeoutExpired`` or
        ``ServiceUnavailable`` (no responder: the replica is gone) otherwise; ``PermissionDenied`` if this caller's
        NATS user may not send it."""
        service = replica.beat.service
        try:
            raw = await guarded(self.nc, [replica.address], self.nc.request(
                replica.address, codec.encode(msg), timeout=timeout_s, headers=nats_headers()))
        except nats.errors.NoRespondersError:
            self.mark_lost(service, replica.replica_id)
            raise ServiceUnavailable(service, f"replica {replica.replica_id} does not answer") from None
        except nats.errors.TimeoutError:
            raise TimeoutExpired(f"service {service!r} replica {replica.replica_id}: no reply within "
                                 f"{timeout_s} s") from None
        reply = codec.decode(raw.data)
        if isinstance(reply, ServiceFault):
            raise ServiceCallFailed(service, reply)
        if expect is not None and not isinstance(reply, expect):
            raise ServiceCallFailed(service, ServiceFault(code="bad_reply", replica_id=replica.replica_id,
                                                          detail=f"a {type(reply).__name__}, not a {expect.__name__}"))
        return reply

    async def call_one(self, service: str, msg: Any, *, timeout_s: float | None = None,
                       expect: type | None = None) -> Any:
        """``msg`` to the least-loaded healthy replica with room, all within ``timeout_s``: while every replica is
        busy (by this caller's estimate, or one answered ``overloaded``) it waits for room; a replica that is gone
        or draining is left for another. Not retried after a request timed out (it may have been served)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        gone: list[str] = []
        while True:
            replica = await self.wait_pick(service, exclude=gone, timeout_s=deadline - time.monotonic(), hold=False)
            replica.in_flight += 1
            try:
                return await self.request(replica, msg, timeout_s=max(deadline - time.monotonic(), 0.001),
                                          expect=expect)
            except (ServiceUnavailable, ServiceCallFailed) as exc:
                if not exc.retriable:
                    raise
                if getattr(exc, "code", "") == "overloaded":
                    replica.refused_since_beat = True  # room again at its next beat, or another replica
                else:
                    gone.append(replica.replica_id)
                log.info("service %s: %s; trying again", service, exc)
            finally:
                replica.in_flight -= 1
                async with self._changed:
                    self._changed.notify_all()

    async def fanout(self, service: str, msg: Any, *, timeout_s: float | None = None,
                     expect: type | None = None) -> dict[str, Any]:
        """``msg`` to every healthy replica at once: ``{replica_id: reply or the exception it raised}``."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        replicas = self.healthy(service)
        if not replicas:
            raise ServiceUnavailable(service, "no healthy replica")
        results = await asyncio.gather(*(self.request(r, msg, timeout_s=timeout_s, expect=expect) for r in replicas),
                                       return_exceptions=True)
        return {r.replica_id: res for r, res in zip(replicas, results)}

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """Every known replica of every service, for ``streamforge status``."""
        now = time.monotonic()
        return {service: [replica_row(r.beat, age_s=r.age(now), healthy=r.healthy(now)) for r in known.values()]
                for service, known in sorted(self.replicas.items())}


def replica_row(beat: ServiceBeat, *, age_s: float, healthy: bool) -> dict[str, Any]:
    return {"replica_id": beat.replica_id, "kind": beat.kind, "address": beat.address, "load": beat.load,
            "capacity": beat.capacity, "state": beat.state, "healthy": healthy, "beat_age_s": round(age_s, 2),
            "host": beat.host, "pid": beat.pid}


async def read_services(nc: NATS, names: Names, *, timeout_s: float = 5.0) -> dict[str, list[dict[str, Any]]]:
    """The registered replicas of every service as ``streamforge status`` lists them (one read, no watch): health
    from the age of each beat by the replica's clock. It creates nothing: no bucket yet, no services."""
    directory = ServiceDirectory(nc, names, timeout_s=timeout_s, create=False)
    try:
        await directory.start()
    except BucketNotFoundError:
        return {}
    try:
        return directory.snapshot()
    finally:
        await directory.stop()
