"""The feeder role: streams a local prompt source into the ``prompts`` topic (the default path to generators).

``FeederRole(cfg, ctx)`` (``streamforge run feeder``) reads ``feeder.source`` (``producers.sources``) and produces
each Prompt to ``{prefix}.prompts`` keyed by ``prompt_id`` (an ``sft_jsonl:`` source produces SFTExamples to
``{prefix}.sft`` keyed by ``example_id`` instead). Each record is acknowledged by the broker before it counts.

Backpressure: at most ``feeder.max_in_flight`` prompts ahead of the generators' committed offsets (the
``{prefix}.generators`` group), so an endless source does not flood the topic. The committed offsets are read by
a consumer that names the group without joining it (OffsetFetch; Tansu answers the admin client's
``list_consumer_group_offsets`` with a frame aiokafka cannot decode); while the feeder is full it re-reads them
every ``_POLL_S`` (the broker offers no event for a group's commits).

After ``feeder.num_prompts`` prompts (0 = endless) the feed loop idles until the role is stopped, and sets
``finished``. A restarted feeder starts its (deterministic) source over: prompts fed twice carry the same ids, so
their episodes have the same ids and the buffer deduplicates them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from opentelemetry import trace

from producers.config import FeederConfig
from producers.sources import open_source, sft_examples
from runtime.context import RoleContext
from runtime.lifecycle import Service
from topics.admin import partitions_of
from topics.config import KafkaConfig
from topics.kafka import Consumer, Producer

log = logging.getLogger("streamforge.feeder")
_tracer = trace.get_tracer("streamforge.feeder")
_POLL_S = 0.5


class FeederRole(Service):
    """See the module docstring."""

    name = "feeder"

    def __init__(self, cfg: FeederConfig, ctx: RoleContext) -> None:
        super().__init__()
        self.cfg = cfg
        self.ctx = ctx
        self.names = ctx.names
        self.drain_timeout_s = ctx.drain_timeout_s
        self.producer: Producer | None = None
        self.offsets: GroupOffsets | None = None
        self.sent = 0
        self.finished = asyncio.Event()
        self._produced: dict[int, tuple[int, int]] = {}  # partition -> (first offset we wrote, next offset)
        self._room = cfg.max_in_flight  # prompts that may be sent before the group's offsets are read again

    async def _start(self) -> None:
        self.producer = Producer(self.ctx.kafka, client_id="feeder")
        await self.producer.start()
        self.offsets = GroupOffsets(self.ctx.kafka, self.names.generators_group, self.names.prompts)
        await self.offsets.start()

    async def _stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()
        if self.offsets is not None:
            with contextlib.suppress(Exception):
                await self.offsets.stop()

    def loops(self) -> dict[str, Any]:
        return {"feed": self._feed()}

    async def _in_flight(self) -> int:
        """Prompts we produced that the generators' group has not committed yet."""
        assert self.offsets is not None
        committed = await self.offsets.read()
        return sum(nxt - max(first, committed.get(p, first)) for p, (first, nxt) in self._produced.items())

    async def _wait_for_room(self) -> None:
        """Take one slot under ``max_in_flight``. The group's offsets are read only when the slots counted at the
        last read are used up (a read is one OffsetFetch per partition: reading them per prompt cost the demo's
        feeder more CPU than the buffer's)."""
        while self._room <= 0:
            self._room = self.cfg.max_in_flight - await self._in_flight()
            if self._room <= 0:
                await asyncio.sleep(_POLL_S)
        self._room -= 1

    async def _feed(self) -> None:
        """Consumes the source; waits for the broker's ack per record and for room under ``max_in_flight``."""
        assert self.producer is not None
        kind, _, arg = self.cfg.source.partition(":")
        if kind == "sft_jsonl":
            for ex in sft_examples(arg, num_examples=self.cfg.num_prompts):
                await self.producer.send(self.names.sft, ex, key=ex.example_id)
                self.sent += 1
        else:
            for prompt in open_source(self.cfg.source, seed=self.cfg.seed, num_prompts=self.cfg.num_prompts):
                await self._wait_for_room()
                with _tracer.start_as_current_span("feeder.prompt", attributes={"prompt_id": prompt.prompt_id}):
                    meta = await self.producer.send(self.names.prompts, prompt, key=prompt.prompt_id)
                first, _ = self._produced.get(meta.partition, (meta.offset, 0))
                self._produced[meta.partition] = (first, meta.offset + 1)
                self.sent += 1
        log.info("feeder: %d records from %s sent", self.sent, self.cfg.source)
        self.finished.set()
        await asyncio.Event().wait()  # idle until the role is stopped (returning would count as a crash)


class GroupOffsets:
    """Reads a consumer group's committed offsets on one topic without joining the group."""

    def __init__(self, kafka_cfg: KafkaConfig, group_id: str, topic: str) -> None:
        self.topic = topic
        self.consumer = Consumer(kafka_cfg, [], group_id=group_id, client_id=f"{group_id}-offsets")

    async def start(self) -> None:
        await self.consumer.start()

    async def stop(self) -> None:
        await self.consumer.stop()

    async def read(self) -> dict[int, int]:
        """``{partition: committed next offset}`` for the partitions the group has committed."""
        out = {}
        for tp in await partitions_of(self.consumer, self.topic):
            offset = await self.consumer.committed(tp)
            if offset is not None and offset >= 0:
                out[tp.partition] = offset
        return out
