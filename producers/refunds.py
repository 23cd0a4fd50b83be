"""Quota refunds from the buffers' decisions: a group of this generator that the buffer dropped trains nothing.

The generator's quota (``producers/flow.py``) counts the groups it took against the trainer's steps. A group the
buffer drops (stale, fenced, incomplete) never becomes part of a step, so without a refund every drop would leave
the quota one group short for good, the buffer would wait for partial batches, and waiting makes more groups
stale. ``DropRefunds`` follows the ``drops`` topic from its end (a group-less reader of every partition; what was
dropped before the generator started is not its concern), and for each ``DropRecord`` of a group this generator
produced (``produced(group_id)``; a bounded memory of recent ids) with one of ``REFUND_REASONS`` it gives that
group's quota back, once. Zero-variance drops are refunded by the generator itself as soon as it scores a group
(``Backpressure.scored``); duplicates and overlong single episodes are not whole-group decisions.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from topics.admin import highwaters, partitions_of
from topics.config import KafkaConfig
from topics.kafka import Consumer
from topics.schemas import DropRecord

log = logging.getLogger("streamforge.generator")

REFUND_REASONS = frozenset({"stale", "fenced", "incomplete"})
MEMORY = 100_000  # recent group ids remembered


class DropRefunds:
    """See the module docstring. ``refund()`` is called once per refunded group."""

    def __init__(self, kafka: KafkaConfig, topic: str, *, refund: Callable[[], None], client_id: str) -> None:
        self.kafka = kafka
        self.topic = topic
        self.refund = refund
        self.client_id = client_id
        self.consumer: Consumer | None = None
        self.refunded = 0
        self._mine: OrderedDict[str, bool] = OrderedDict()  # group id -> refunded already

    def produced(self, group_id: str) -> None:
        self._mine[group_id] = False
        while len(self._mine) > MEMORY:
            self._mine.popitem(last=False)

    async def start(self) -> None:
        """Assign every partition of the drops topic at its current end (high-water mark)."""
        ends = await highwaters(self.kafka, self.topic)
        self.consumer = Consumer(self.kafka, [], group_id=None, expect=DropRecord, client_id=self.client_id)
        await self.consumer.start()
        tps = await partitions_of(self.consumer, self.topic)
        self.consumer.raw.assign(tps)
        for tp in tps:
            self.consumer.seek(tp, ends.get(tp.partition, 0))

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None

    def on_drop(self, drop: DropRecord) -> bool:
        """Refund the dropped group if it is ours and not refunded yet; True when it was refunded."""
        if drop.reason not in REFUND_REASONS or self._mine.get(drop.group_id, True):
            return False
        self._mine[drop.group_id] = True
        self.refunded += 1
        self.refund()
        return True

    async def loop(self) -> None:
        """Consumes the drops topic (waits on the broker's fetch); never returns. An undecodable record is
        skipped: the buffer's own outputs are read here only to give quota back."""
        assert self.consumer is not None
        while True:
            for rec in await self.consumer.getmany(timeout_ms=1000):
                if rec.value is not None:
                    self.on_drop(rec.value)
