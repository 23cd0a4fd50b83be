"""The simulated generators' prompts from Kafka: one member of the run's ``generators`` group per process.

``PromptFeed`` consumes the ``prompts`` topic (what the real feeder, ``streamforge run feeder``, produces) as one
member of ``{prefix}.generators`` for all of its process's simulated generators: ``take()`` hands out the next
prompt, fetching a few at a time; ``done(prompt)`` marks it finished once its Episodes were acknowledged by the
broker, and the contiguous finished prefix of each partition is committed in the background
(``producers.flow.OffsetTracker``, as ``producers/intake.py`` commits). A record that does not decode is
dead-lettered and committed past; a prompt taken and not finished when the process stops stays uncommitted, and
the group hands it out again. Before partitions are revoked the finished prefix is committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from aiokafka.abc import ConsumerRebalanceListener

from producers.flow import OffsetTracker
from topics.config import KafkaConfig
from topics.errors import BrokerError
from topics.kafka import Consumer, DeadLetters, Received
from topics.names import Names
from topics.schemas import Prompt

log = logging.getLogger("bench.sim.prompts")


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, feed: PromptFeed) -> None:
        self.feed = feed

    async def on_partitions_revoked(self, revoked: Any) -> None:
        try:
            await self.feed.commit()
        except BrokerError as exc:  # the group moved on: the new owner redoes what was not committed
            log.warning("commit before rebalance failed: %s", exc)
        self.feed.offsets.forget(revoked)
        self.feed.forget(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.feed.assigned.set()


class PromptFeed:
    """See the module docstring."""

    def __init__(self, kafka: KafkaConfig, names: Names, dead: DeadLetters, client_id: str) -> None:
        self.consumer = Consumer(kafka, [names.prompts], group_id=names.generators_group, expect=Prompt,
                                 client_id=client_id, listener=_Rebalance(self))
        self.dead = dead
        self.offsets = OffsetTracker()
        self.assigned = asyncio.Event()
        self.queue: deque[Received] = deque()
        self.stats = {"consumed": 0, "dead_lettered": 0, "commits": 0}
        self._fetch = asyncio.Lock()
        self._commit_lock = asyncio.Lock()
        self._committer: asyncio.Task | None = None
        self._commit_wanted = False
        self.failure: BaseException | None = None

    async def start(self) -> None:
        await self.consumer.start()

    async def stop(self) -> None:
        if self._committer is not None:
            await asyncio.gather(self._committer, return_exceptions=True)
        await self.commit()
        await self.consumer.stop()

    def forget(self, tps: Any) -> None:
        gone = set(tps)
        self.queue = deque(r for r in self.queue if r.tp not in gone)

    async def take(self, want: int = 1) -> Received:
        """The next prompt record (its ``value`` a ``Prompt``), fetching up to ``want`` when none is queued.
        Waits on the broker."""
        async with self._fetch:
            while not self.queue:
                records = await self.consumer.getmany(timeout_ms=500, max_records=max(1, want))
                for rec in records:
                    self.offsets.take(rec.tp, rec.offset)
                    if rec.error is not None or rec.value is None:
                        await self.dead.send(rec, reason="", detail=str(rec.error))
                        self.stats["dead_lettered"] += 1
                        self.offsets.done(rec.tp, rec.offset)
                    else:
                        self.queue.append(rec)
            rec = self.queue.popleft()
            self.stats["consumed"] += 1
            return rec

    def done(self, rec: Received) -> None:
        """``rec``'s Episodes are on the broker: its offset may be committed."""
        self.offsets.done(rec.tp, rec.offset)
        self._commit_wanted = True
        if self._committer is None or self._committer.done():
            self._committer = asyncio.ensure_future(self._commit_loop())
            self._committer.add_done_callback(self._committed)

    def _committed(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()

    async def _commit_loop(self) -> None:
        """Commits until no prompt finished during the last commit (``done`` restarts it)."""
        while self._commit_wanted:
            self._commit_wanted = False
            await self.commit()

    async def commit(self) -> None:
        async with self._commit_lock:
            offsets = self.offsets.committable()
            if not offsets:
                return
            try:
                await self.consumer.commit(offsets)  # type: ignore[arg-type]
            except BrokerError as exc:
                log.warning("commit of %s failed (the group rebalanced; the prompts will be redone): %s",
                            offsets, exc)
                return
            self.offsets.committed(offsets)
            self.stats["commits"] += 1
