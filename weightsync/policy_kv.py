"""The trainer's writes to the run's policy KV bucket: the ``latest`` version it owns and the fencing record.

``PolicyKV.store_version(pv)`` compare-and-sets ``latest``. The trainer owns the key: when the set fails, the value
there decides. This trainer's own earlier write of ``pv`` (an attempt that timed out during a NATS outage, then
landed) is success; a value that does not decode, or an older or equal version written by someone else, is
dead-lettered (source ``kv:<bucket>/latest``) and overwritten (compare-and-set on its revision); only a newer
version from another trainer raises ``StaleWriter`` (this one is a zombie). Each attempt is bounded by
``timeout_s``; an unreachable store is retried with backoff, so a round waits out a NATS outage.

``write_fenced()`` writes the ``fenced`` key (``weightsync/members.py``). A failure never fails a round: it is
counted, logged and retried in the background with backoff (and by the next round) until it lands or ``stop``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import nats.errors

from topics import codec
from topics.deadlines import within
from topics.errors import CodecError, InvalidMessage, StaleWriter
from topics.nats import OnBadMessage, PolicyStore
from topics.schemas import PolicyVersion
from weightsync.members import FENCED_KEY, Registry

log = logging.getLogger("streamforge.weightsync.publisher")


class PolicyKV:
    """The publisher's side of the policy bucket; ``counters`` is the publisher's (``kv_failures``,
    ``fence_write_failures``, ``bad_latest``)."""

    def __init__(self, store: PolicyStore, registry: Registry, *, timeout_s: float, counters: Counter[str],
                 metric: Callable[[str, float], None]) -> None:
        self.store = store
        self.registry = registry
        self.timeout_s = timeout_s
        self.counters = counters
        self.metric = metric
        self.on_bad: OnBadMessage | None = None  # where values it cannot use go (the trainer dead-letters them)
        self.rev = 0  # revision of ``latest`` this trainer's next compare-and-set expects
        self.fence_dirty = False  # the last write of the fencing record failed: it is being retried
        self._bg: set[asyncio.Task] = set()
        self._stopped = False

    async def read_latest(self) -> PolicyVersion | None:
        """The newest decodable ``latest`` (bad values are dead-lettered on the way) and its revision."""
        pv, self.rev = await self.store.latest_good(on_bad=self.bad_latest)
        return pv

    def stop(self) -> None:
        self._stopped = True
        for task in list(self._bg):
            task.cancel()

    async def bad_latest(self, source: str, value: bytes, exc: CodecError) -> None:
        """A value of ``latest`` this trainer did not write and cannot use: counted and dead-lettered."""
        self.counters["bad_latest"] += 1
        log.warning("the policy store's latest value is not this trainer's (%s): it will be rewritten", exc)
        if self.on_bad is not None:
            await self.on_bad(source, value, exc)

    async def store_version(self, pv: PolicyVersion) -> int:
        """Compare-and-set ``pv`` as ``latest`` (module docstring); returns the new revision."""
        delay = 0.5
        while True:
            try:
                self.rev = await within(self.store.publish(pv, expected_revision=self.rev), self.timeout_s)
                return self.rev
            except StaleWriter:
                value, rev = await within(self.store.entry(self.store.names.LATEST_KEY), self.timeout_s)
                verdict = await self._after_failed_set(pv, value, rev)
                if verdict == "stale":
                    raise
                self.rev = rev  # "ours" landed there; "overwrite" compare-and-sets again on it
                if verdict == "ours":
                    return rev
            except (TimeoutError, nats.errors.Error, OSError) as exc:
                self.counters["kv_failures"] += 1
                log.warning("version %d: the policy store is unreachable (%s: %s); retrying in %.1f s",
                            pv.version, type(exc).__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _after_failed_set(self, pv: PolicyVersion, value: bytes | None, rev: int) -> str:
        """What the value at revision ``rev`` means for ``pv`` after a failed compare-and-set: ``"ours"`` (this
        very write had landed), ``"overwrite"`` (dead-lettered; write ``pv`` on ``rev``) or ``"stale"`` (a newer
        version of another trainer)."""
        if value is None:
            return "overwrite"  # deleted or purged: ours to write again
        try:
            there = codec.decode(value, expect=PolicyVersion)
        except CodecError as exc:
            await self.bad_latest(self.store.latest_source, value, exc)
            return "overwrite"
        if there.trainer_id == pv.trainer_id and there.version == pv.version:
            return "ours"
        if there.trainer_id != pv.trainer_id and there.version >= pv.version:
            log.error("version %d: trainer %r already published version %d: this trainer is stale", pv.version,
                      there.trainer_id, there.version)
            return "stale"
        await self.bad_latest(self.store.latest_source, value, InvalidMessage(
            f"version {there.version} of {there.trainer_id!r} at revision {rev}, not written by this trainer"))
        return "overwrite"

    async def write_fenced(self) -> None:
        """Write the fencing record; a failure is counted, reported and retried (module docstring)."""
        try:
            await within(self.store.put(FENCED_KEY, self.registry.fenced_json()), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - never fail a round on the bookkeeping write; it is retried
            self.counters["kv_failures"] += 1
            self.counters["fence_write_failures"] += 1
            self.metric("weightsync/fence_write_failures", self.counters["fence_write_failures"])
            log.error("could not write the fencing record (%d bytes, %d fenced): %s; retrying",
                      len(self.registry.fenced_json()), len(self.registry.fenced), exc)
            if not self.fence_dirty:
                self.fence_dirty = True
                self.spawn(self._retry_fenced())
            return
        self.fence_dirty = False

    async def _retry_fenced(self) -> None:
        delay = 0.5
        while self.fence_dirty and not self._stopped:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
            self.fence_dirty = False  # write_fenced sets it again on failure, without a second retry task
            try:
                await within(self.store.put(FENCED_KEY, self.registry.fenced_json()), self.timeout_s)
                log.info("fencing record written after a retry")
            except Exception as exc:  # noqa: BLE001 - retried until it lands or the publisher stops
                self.fence_dirty = True
                self.counters["fence_write_failures"] += 1
                log.warning("fencing record retry failed: %s", exc)

    def spawn(self, coro: Any) -> None:
        """A background write, cancelled by ``stop``."""
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
