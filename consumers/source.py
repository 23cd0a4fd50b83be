"""Where the trainer's records come from: every partition of one topic, read from explicit offsets.

The trainer does not trust the consumer group's committed offsets: it assigns every partition of the topic
(``batches`` in RL mode, ``sft`` in SFT mode) and seeks to the offsets stored in its latest checkpoint (offset 0
for a partition the checkpoint does not name, i.e. a fresh run). ``offsets`` advances only when the caller
``advance``s a record it finished (trained, skipped as a duplicate, or dead-lettered), so a checkpoint's offsets
are exactly "everything before these has been accounted for". Commits to the trainers' group
(``names.trainers_group``) are advisory (lag monitoring, ``streamforge status``) and best effort.

One job consumes a topic: rank 0 of the trainer job reads, the other ranks receive from it (``engine.py``).
"""

from __future__ import annotations

import collections
import logging

from topics.admin import partitions_of
from topics.config import KafkaConfig
from topics.errors import BrokerError
from topics.kafka import Consumer, DeadLetters, Received, TopicPartition

log = logging.getLogger("streamforge.trainer.source")


def tp_key(tp: TopicPartition) -> str:
    return f"{tp.topic}:{tp.partition}"


class RecordSource:
    """Decoded records of ``topic`` in offset order per partition; undecodable ones go to the dead-letter topic."""

    def __init__(self, kafka_cfg: KafkaConfig, topic: str, *, group_id: str, expect: type,
                 dead_letters: DeadLetters | None, client_id: str = "trainer") -> None:
        self.topic = topic
        self.group_id = group_id
        self.consumer = Consumer(kafka_cfg, [], group_id=group_id, expect=expect, client_id=client_id)
        self.dead_letters = dead_letters
        self.offsets: dict[str, int] = {}
        self._pending: collections.deque[Received] = collections.deque()
        self._tps: list[TopicPartition] = []

    async def start(self, offsets: dict[str, int]) -> None:
        """Assign every partition and seek each to ``offsets`` (``"topic:partition" -> next offset``) or 0."""
        await self.consumer.start()
        self._tps = await partitions_of(self.consumer, self.topic)
        self.consumer.raw.assign(self._tps)
        for tp in self._tps:
            start = int(offsets.get(tp_key(tp), 0))
            self.consumer.seek(tp, start)
            self.offsets[tp_key(tp)] = start
        log.info("trainer reads %s from %s", self.topic, self.offsets)

    async def stop(self) -> None:
        await self.consumer.stop()

    async def next(self, timeout_ms: int) -> Received | None:
        """The next decodable record (waiting up to ``timeout_ms`` for one), or None.

        Undecodable records are dead-lettered and advanced past here; the caller never sees them.
        """
        while True:
            if not self._pending:
                self._pending.extend(await self.consumer.getmany(timeout_ms=timeout_ms))
                if not self._pending:
                    return None
            rec = self._pending.popleft()
            if rec.offset < self.offsets.get(tp_key(rec.tp), 0):
                continue  # re-delivered below our position (after a seek)
            if rec.error is None:
                return rec
            if self.dead_letters is not None:
                await self.dead_letters.send(rec)
            self.advance(rec)

    def advance(self, rec: Received) -> None:
        """Mark ``rec`` as accounted for: the next offset of its partition becomes ``rec.offset + 1``."""
        self.offsets[tp_key(rec.tp)] = rec.offset + 1

    async def commit(self) -> None:
        """Advisory commit of ``offsets`` to the trainers' group; failures are logged, never fatal."""
        offsets = {tp: self.offsets[tp_key(tp)] for tp in self._tps if self.offsets.get(tp_key(tp), 0) > 0}
        try:
            await self.consumer.commit(offsets)
        except BrokerError as exc:
            log.warning("advisory commit to %s failed: %s", self.group_id, exc)

    async def lag(self) -> int:
        return sum((await self.consumer.lag()).values())
