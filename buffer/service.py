"""``BufferRole``: the replay-buffer process (``streamforge run buffer``).

It consumes the ``episodes`` topic in the buffers' consumer group (several buffer processes split the partitions;
episodes are keyed by group_id so a group is whole in one partition), runs the state machine of
``buffer/state.py``, publishes ``Batch`` records (key = batch_id) to ``batches`` and ``DropRecord`` records (key =
group_id) to ``drops``, dead-letters undecodable or invalid records, and watches the latest ``PolicyVersion`` in
the NATS KV store for the staleness filter and the fencing record (``weightsync/fencing.py``) for the fenced
filter.

Delivery and crash safety:

* Offsets of an episodes partition are committed only up to the lowest offset still held by an unfinished group,
  batch or drop, i.e. after the broker acknowledged the batch or drop holding every earlier record. A crash
  therefore replays, it never loses.
* Replayed records whose decision was already published are not decided twice: whenever partitions are
  assigned (start-up, restart after a crash, rebalance) the buffer first reads the recent ``batches`` and
  ``drops`` records back (``buffer/recovery.py``) and marks those episodes DECIDED; their replays are skipped.
  This is the primary guarantee, and it holds whatever the timing.
* Second line, for a decision the scan could not see (published after it, e.g. by a zombie owner whose session
  had expired): grouping is deterministic. A group's episodes are sorted by episode_id, a batch holds groups of
  one partition cut in the order they completed there, and ``batch_id`` is a hash of the sorted episode ids.
  So a batch whose groups lie wholly after the committed offset, re-formed from the same completions, gets the
  same batch_id and the trainer deduplicates it. That is not guaranteed in general: a decided group straddling
  the committed offset comes back partial (dropped as ``incomplete`` after its timeout, or batched partially
  with ``incomplete_policy="complete"``), batch boundaries can shift, and time-based cuts (``max_batch_wait_s``,
  group timeouts, staleness against a newer version) differ between runs. Such an episode ends up in two
  batches with different ids: the audit reports it as ``in_two_batches``.
* Last line, for those: the trainer refuses a batch holding an episode it already trained (``TrainedEpisodes`` in
  ``consumers/ledger.py``; dead-lettered as ``already_trained``), so no episode is trained twice whatever a
  zombie publishes. Fencing the zombie before it publishes is not possible here: without transactions (Tansu has
  none) a generation check and the publish cannot be made atomic.
* A record never received while later ones were (an offset gap: the embedded broker can serve a concurrent later
  produce before an earlier one is written) is never committed past: each partition's commit is capped at its
  first offset not received, and the buffer reads the partition again from the gap until the record arrives; a gap
  open ``offset_gap_fail_s`` turns the role's health to failing, naming partition and offset (``health()``, the
  log, ``<run_dir>/health-<buffer_id>.json``), while it keeps re-reading and holding the commit (``buffer/gaps.py``).
* On a rebalance the revoked partitions' in-flight publishes finish (the revoke callback waits for the loop's
  lock) before their state is dropped, so the new owner's recovery scan sees them.

Throughput: decisions are handed to the producer without waiting for their acknowledgements (``_settle`` marks
them decided as acks arrive, in order); offsets are committed at most every ``commit_interval_s``; the producer's
record batches hold ``output_batch_bytes`` (several Batches per request: aiokafka has one request in flight per
broker, one record batch per partition in it).

Trainer behind (``max_batches_ahead > 0``): at most that many batches are published beyond the step of the
latest PolicyVersion; complete groups wait scored in memory (re-checked for staleness as versions move) and the
cap below then stops consumption, so a stalled trainer leaves its backlog in Kafka.

Backpressure: the loop fetches at most ``max_pending_episodes - held`` records and pauses the consumer while
``held >= max_pending_episodes`` (the backlog stays in Kafka, not in RAM); held records drain as groups complete
or time out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from aiokafka.abc import ConsumerRebalanceListener
from opentelemetry import trace

from buffer.config import BufferConfig
from buffer.gaps import GapGuard, GapReader
from buffer.pace import TrainerPace
from buffer.policies import Reason
from buffer.recovery import committed_since_ms, highwaters, read_decided
from buffer.state import BufferState, Decision
from runtime.context import RoleContext
from runtime.lifecycle import Service
from topics.errors import BrokerError, CodecError
from topics.kafka import Consumer, DeadLetters, Producer, Received, TopicPartition
from topics.nats import PolicyStore, connect
from topics.schemas import DropRecord, Episode
from topics.tracing import context_from_kafka, link_to
from weightsync.fencing import FenceView

try:
    from runtime.metrics import flush_metrics, record_metric
except ImportError:  # pragma: no cover - metrics are optional
    record_metric = flush_metrics = None  # type: ignore[assignment]

log = logging.getLogger("streamforge.buffer")
tracer = trace.get_tracer("streamforge.buffer")

MAX_LINKS = 64
REPORT_EVERY_S = 5.0


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, role: BufferRole) -> None:
        self.role = role

    async def on_partitions_revoked(self, revoked: Any) -> None:
        try:
            await self.role._on_revoked(set(revoked))
        except Exception as exc:  # noqa: BLE001 - aiokafka only logs listener errors: the loop re-raises it
            self.role._listener_error = exc

    async def on_partitions_assigned(self, assigned: Any) -> None:
        try:
            await self.role._on_assigned(set(assigned))
        except Exception as exc:  # noqa: BLE001 - aiokafka only logs listener errors: the loop re-raises it
            self.role._listener_error = exc


class BufferRole(Service):
    """The replay buffer as a supervised service: loops ``consume`` and ``policy`` (contracts on each)."""

    name = "buffer"

    def __init__(self, cfg: BufferConfig, ctx: RoleContext) -> None:
        super().__init__()
        self.cfg = cfg
        self.ctx = ctx
        self.names = ctx.names
        self.buffer_id = self.cfg.buffer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.state = BufferState(self.cfg, buffer_id=self.buffer_id)
        self.pace = TrainerPace()  # the trainer's published versions and progress (buffer/pace.py)
        self._batch_hw: dict[int, int] = {}  # batches-topic high-water marks known from our acks
        self.counters: dict[str, int] = {"dead_lettered": 0, "pauses": 0, "commits": 0, "commit_failures": 0,
                                         "rebalances": 0, "recovered_ids": 0, "discarded_after_revoke": 0,
                                         "discarded_before_assign": 0}
        # offsets never received are read again, never committed past (buffer/gaps.py)
        self.gaps = GapReader(GapGuard(fail_after_s=cfg.offset_gap_fail_s, counters=self.counters),
                              topic=self.names.episodes, buffer_id=self.buffer_id,
                              health_path=Path(ctx.run_dir) / f"health-{self.buffer_id}.json")
        self._lock = asyncio.Lock()  # one loop iteration, or one rebalance step, at a time
        self._epoch = 0  # bumped on every revoke: records fetched before it are discarded
        self._committed: dict[int, int] = {}
        self._inflight: list[tuple[Decision, asyncio.Future]] = []  # published, not yet acknowledged
        self._last_commit = 0.0
        self._paused = False
        self._draining = False
        self._listener_error: Exception | None = None  # a failed rebalance step (recovery) ends the role
        self._last_report = time.monotonic()
        self._reports = 0
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.store: PolicyStore | None = None
        self.dead: DeadLetters | None = None
        self.fence: FenceView | None = None
        self._nc: Any = None

    @property
    def latest_version(self) -> int | None:
        """The latest PolicyVersion read from the store (the stale filter's reference)."""
        return self.pace.latest_version

    # -- lifecycle ----------------------------------------------------------------------------
    async def _start(self) -> None:
        kafka = self.ctx.kafka
        out_cfg = dataclasses.replace(kafka, compression=self.cfg.output_compression or kafka.compression)
        self.producer = Producer(out_cfg, client_id=f"buffer-{self.buffer_id}",
                                 max_batch_bytes=self.cfg.output_batch_bytes)
        await self.producer.start()
        self.dead = DeadLetters(self.producer, self.names, "buffer")
        self._nc = await connect(self.ctx.nats, name=f"buffer-{self.buffer_id}")
        self.store = PolicyStore(self._nc, self.names, history=self.ctx.nats.kv_history,
                                 timeout_s=self.ctx.nats.request_timeout_s)
        await self.store.start()
        self.fence = FenceView(self._nc, self.names)
        await self.fence.start()
        pv, _ = await self.store.latest_good(on_bad=self._dead_letter_value)  # past a bad value: the last good
        self.pace = TrainerPace(pv)
        if self.cfg.max_batches_ahead > 0:
            self._batch_hw = await highwaters(kafka, self.names.batches)
        self.consumer = Consumer(kafka, [self.names.episodes], group_id=self.names.buffers_group, expect=Episode,
                                 client_id=f"buffer-{self.buffer_id}", listener=_Rebalance(self),
                                 fetch_min_bytes=self.cfg.fetch_min_bytes)
        await self.consumer.start()
        self.gaps.check_health(time.monotonic())  # healthy: the health file says so from the start
        log.info("buffer %s started (latest policy version %s)", self.buffer_id, self.pace.latest_version)

    async def _stop(self) -> None:
        for client in (self.consumer, self.producer):
            if client is not None:
                try:
                    await client.stop()
                except Exception as exc:  # noqa: BLE001 - closing; report, do not mask why we stop
                    log.warning("buffer %s: closing %s: %s", self.buffer_id, type(client).__name__, exc)
        if self._nc is not None:
            try:
                await self._nc.close()
            except Exception as exc:  # noqa: BLE001 - closing
                log.warning("buffer %s: closing NATS: %s", self.buffer_id, exc)
        self._report(force=True)

    def loops(self) -> dict[str, Any]:
        assert self.fence is not None
        return {"consume": self._consume_loop(), "policy": self._policy_loop(), "progress": self._progress_loop(),
                "fence": self._fence_loop()}

    async def drain(self) -> None:
        """Stop taking episodes, publish what can be published (partial batches too), commit."""
        self._draining = True
        async with self._lock:
            assert self.consumer is not None
            self.consumer.pause()
            await self._decide(final=True)
            await self._settle(wait=True)
            await self._commit(force=True)

    # -- loops --------------------------------------------------------------------------------
    async def _consume_loop(self) -> None:
        """Consumes ``episodes`` (buffers' group); publishes batches and drops; commits finished offsets.

        Waits on the consumer's fetch for at most ``poll_ms``, and no later than the state's next timer deadline
        (so a partial batch or a group timeout fires on time without records); while ``held >=
        max_pending_episodes`` it does not fetch and only waits for those timers (acknowledgements, group
        timeouts, partial-batch deadlines or the trainer's progress free room). Each iteration holds the
        lock so a rebalance callback never interleaves with a half-published decision. Runs until cancelled; any
        error ends the role.
        """
        assert self.consumer is not None
        poll_ms = int(1000 * min(0.5, self.cfg.max_batch_wait_s / 2, self.cfg.group_timeout_s / 4))
        while True:
            room = self.cfg.max_pending_episodes - self.state.held
            epoch = self._epoch
            records: list[Received] = []
            wait_ms = self._wait_ms(poll_ms)
            if room > 0 and not self._draining:
                records = await self.consumer.getmany(timeout_ms=wait_ms,
                                                      max_records=min(room, self.cfg.poll_max_records))
            else:
                await asyncio.sleep(wait_ms / 1000)  # paused: only the timers can free room
            async with self._lock:
                if self._listener_error is not None:
                    raise RuntimeError(f"rebalance handling failed: {self._listener_error!r}") from self._listener_error
                if self._draining:
                    continue
                await self._handle(records, epoch)
                now = time.monotonic()
                self.gaps.resume_due(self.consumer, now, paused=self._paused)
                self.gaps.check_health(now)
                await self._decide(final=False)
                await self._settle(wait=False)
                await self._commit()
                self._backpressure()
            self._report()

    def _wait_ms(self, poll_ms: int) -> int:
        """How long the loop may wait for records: ``poll_ms``, cut to the state's next timer deadline or a paused
        partition's next re-read of its offset gap (+1 ms, so the deadline has passed when the loop looks). A
        deadline already past (a due batch held back by ``max_batches_ahead``) does not shorten it: only the
        trainer's progress or new records change that."""
        deadlines = [d for d in (self.state.next_deadline(), self.gaps.next_resume()) if d is not None]
        if not deadlines:
            return poll_ms
        left = min(deadlines) - time.monotonic()
        return poll_ms if left <= 0 else min(poll_ms, math.ceil(left * 1000) + 1)

    async def _policy_loop(self) -> None:
        """Watches the NATS KV ``latest`` PolicyVersion; updates ``latest_version`` (used by the stale filter) and
        the trainer's published step (``_trainer_moved``).

        Waits on the KV watch; unblocked by each write of a new version. Runs until cancelled.
        """
        assert self.store is not None
        async for pv in self.store.watch(on_bad=self._dead_letter_value):
            if self.pace.on_version(pv) and record_metric is not None:
                record_metric("buffer/latest_version", pv.version, "max")
            await self._trainer_moved(pv.step)
        raise RuntimeError("the policy-version watch ended")

    async def _progress_loop(self) -> None:
        """Watches the trainer's ``progress`` KV key (steps trained, after every step): the batches queued for the
        trainer are those published beyond it. Waits on the KV watch; runs until cancelled."""
        assert self.store is not None
        async for progress in self.store.watch_progress(on_bad=self._dead_letter_value):
            consumed_more = self.pace.on_progress(progress)
            await self._trainer_moved(progress.step, force=consumed_more)
        raise RuntimeError("the trainer-progress watch ended")

    async def _trainer_moved(self, step: int, *, force: bool = False) -> None:
        """The trainer has trained ``step`` steps (or consumed more, ``force``). When that is news and batches were
        held back by ``max_batches_ahead``, decide at once (under the loop's lock) instead of waiting for the
        consume loop's next fetch to end: the trainer waits for that batch."""
        moved = self.pace.trained(step) or force
        if moved and self.cfg.max_batches_ahead > 0 and self.state.has_ready() and not self._draining:
            async with self._lock:
                if not self._draining:
                    await self._decide(final=False)
                    await self._settle(wait=False)

    async def _dead_letter_value(self, source: str, value: bytes, exc: CodecError) -> None:
        """A NATS value this buffer cannot read (the KV's latest version or fencing record): dead-lettered."""
        assert self.dead is not None
        await self.dead.send_undecodable(source, value, exc)
        self.counters["bad_nats_values"] = self.counters.get("bad_nats_values", 0) + 1

    async def _fence_loop(self) -> None:
        """Follows the fencing record (KV key ``fenced``, written by the trainer's weight publisher) for the
        ``fenced`` filter. Waits on the KV watch only; runs until cancelled."""
        assert self.fence is not None
        await self.fence.loop(on_bad=self._dead_letter_value)
        raise RuntimeError("the fencing watch ended")

    # -- one iteration ------------------------------------------------------------------------
    async def _handle(self, records: list[Received], epoch: int) -> None:
        assert self.consumer is not None and self.dead is not None
        if not records:
            return
        assigned = {tp.partition for tp in self.consumer.assignment() if tp.topic == self.names.episodes}
        now = time.monotonic()
        self.gaps.new_fetch()
        for rec in records:
            if epoch != self._epoch or rec.partition not in assigned:
                self.counters["discarded_after_revoke"] += 1  # refetched by whoever owns it now
                continue
            if not self.gaps.accept(self.consumer, rec.partition, rec.offset, now):
                continue  # received before, or beyond a gap: read again from the gap (buffer/gaps.py)
            if rec.error is not None or rec.value is None:
                await self.dead.send(rec)
                self.counters["dead_lettered"] += 1
                self.state.skip(rec.partition, rec.offset)
                continue
            # the trace headers, turned into span links only when a span records (tracing is on)
            ctx = rec.headers if "traceparent" in rec.headers else None
            self.state.add(rec.value, partition=rec.partition, offset=rec.offset, now=now, context=ctx)

    def batches_ahead(self) -> int:
        """Batches published (acknowledged or in flight) and not consumed by the trainer yet: beyond the records it
        consumed (its progress: trained, refused or skipped alike), else beyond its latest trained step."""
        inflight = sum(1 for d, _ in self._inflight if d.kind == "batch")
        return sum(self._batch_hw.values()) + inflight - self.pace.consumed()

    async def _decide(self, *, final: bool) -> None:
        room, future, reference = None, None, None
        if self.cfg.max_batches_ahead > 0:
            ahead = max(0, self.batches_ahead())
            room = max(0, self.cfg.max_batches_ahead - ahead)
            future, reference = self.pace.future_versions(ahead)
        decisions = self.state.take_decisions(now=time.monotonic(), latest_version=self.pace.latest_version,
                                              final=final, max_batches=room, future_versions=future,
                                              reference_version=reference,
                                              fenced=self.fence.fenced if self.fence is not None else None)
        if decisions:
            await self._publish(decisions)

    async def _publish(self, decisions: list[Decision]) -> None:
        """Hand every decision to the producer (pipelined); ``_settle`` marks them decided once acknowledged."""
        assert self.producer is not None
        drops = self.drop_counts()
        for d in decisions:
            if d.kind != "batch":
                drops[d.reason] = drops.get(d.reason, 0) + len(d.episode_ids)
            elif d.batch is not None:  # the trainer copies these into its metrics.jsonl rows
                d.batch.stats.update({f"dropped/{r}": float(n) for r, n in drops.items()})
            name = "buffer.batch" if d.kind == "batch" else "buffer.drop"
            with tracer.start_as_current_span(name) as span:
                if span.is_recording():  # links to the spans that produced the episodes
                    for headers in d.contexts[:MAX_LINKS]:
                        link = link_to(context_from_kafka(headers))
                        if link is not None:
                            span.add_link(link.context)
                span.set_attribute("buffer.episodes", len(d.episode_ids))
                span.set_attribute("buffer.groups", d.group_ids[:MAX_LINKS])
                span.set_attribute("buffer.partition", d.partition)
                if d.kind == "batch":
                    assert d.batch is not None
                    span.set_attribute("buffer.batch_id", d.batch.batch_id)
                    fut = await self.producer.enqueue(self.names.batches, d.batch, key=d.batch.batch_id)
                else:
                    span.set_attribute("buffer.reason", d.reason)
                    rec = DropRecord(episode_ids=d.episode_ids, reason=d.reason, group_id=d.group_id,
                                     detail=d.detail, buffer_id=self.buffer_id)
                    fut = await self.producer.enqueue(self.names.drops, rec, key=d.group_id)
            self._inflight.append((d, fut))

    def drop_counts(self) -> dict[str, int]:
        """Episodes dropped so far, by reason: acknowledged drops, in-flight ones, and dead-lettered (malformed)."""
        out = {k.removeprefix("dropped_"): v for k, v in self.state.counters.items() if k.startswith("dropped_")}
        for d, _ in self._inflight:
            if d.kind != "batch":
                out[d.reason] = out.get(d.reason, 0) + len(d.episode_ids)
        if self.counters.get("dead_lettered"):
            out["malformed"] = out.get("malformed", 0) + self.counters["dead_lettered"]
        return out

    async def _settle(self, *, wait: bool) -> None:
        """Mark acknowledged decisions DECIDED, in publication order (all of them, waiting, with ``wait``).

        A publish the producer gave up on raises: the role stops and its successor replays (nothing committed).
        """
        if wait and self._inflight:
            await asyncio.wait([f for _, f in self._inflight])
        while self._inflight and self._inflight[0][1].done():
            d, fut = self._inflight.pop(0)
            meta = fut.result()
            if d.kind == "batch":
                self._batch_hw[meta.partition] = max(self._batch_hw.get(meta.partition, 0), meta.offset + 1)
            self.state.ack(d)
            if record_metric is not None:
                key = "buffer/batches" if d.kind == "batch" else f"buffer/dropped/{d.reason}"
                record_metric(key, 1 if d.kind == "batch" else len(d.episode_ids), "sum")

    async def _commit(self, *, force: bool = False) -> None:
        assert self.consumer is not None
        now = time.monotonic()
        if not force and now - self._last_commit < self.cfg.commit_interval_s:
            return
        self._last_commit = now
        assigned = {tp.partition for tp in self.consumer.assignment() if tp.topic == self.names.episodes}
        committable = {p: self.gaps.guard.limit(p, off)  # never past an offset not received (buffer/gaps.py)
                       for p, off in self.state.committable().items() if p in assigned}
        offsets = {TopicPartition(self.names.episodes, p): off for p, off in committable.items()
                   if self._committed.get(p) != off}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except BrokerError as exc:
            if not exc.retriable:
                raise
            self.counters["commit_failures"] += 1  # a rebalance: the next owner replays, recovery dedups
            log.warning("buffer %s: commit failed (%s); will retry", self.buffer_id, exc)
            return
        self.counters["commits"] += 1
        for tp, off in offsets.items():
            self._committed[tp.partition] = off

    def _backpressure(self) -> None:
        assert self.consumer is not None
        over = self.state.held >= self.cfg.max_pending_episodes
        if over:
            self.consumer.pause()  # also covers partitions assigned since the last pause
            if not self._paused:
                self.counters["pauses"] += 1
                log.info("buffer %s: %d episodes held, pausing consumption", self.buffer_id, self.state.held)
        elif self._paused and not self._draining:
            tps = [tp for tp in self.consumer.assignment() if tp.partition not in self.gaps.waiting]
            if tps:  # a partition waiting for its gap's next re-read stays paused until then
                self.consumer.resume(*tps)
        self._paused = over

    # -- rebalance ----------------------------------------------------------------------------
    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        parts = [tp.partition for tp in revoked if tp.topic == self.names.episodes]
        if not parts:
            return  # the first join revokes nothing
        async with self._lock:  # in-flight publishes of these partitions finish first
            await self._settle(wait=True)
            # records fetched before this revoke are discarded: the next assignment resets every position to
            # the committed offset, so they are fetched again by whoever owns their partition then
            self._epoch += 1
            self.state.revoke(parts)
            self.gaps.forget(set(parts))
            for p in parts:
                self._committed.pop(p, None)
            self.counters["rebalances"] += 1

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        """Before consuming new partitions, learn which of their replayed episodes are already decided."""
        tps = [tp for tp in assigned if tp.topic == self.names.episodes]
        log.info("buffer %s: partitions assigned %s", self.buffer_id, sorted(tp.partition for tp in tps))
        if not tps:
            return
        assert self.consumer is not None
        async with self._lock:
            committed = {tp: await self.consumer.committed(tp) for tp in tps}
            await self.gaps.start(self.consumer, committed)  # where each partition's first record is expected
            since = await committed_since_ms(self.ctx.kafka, committed, self.cfg.recovery_skew_s)
            if since is None:
                log.info("buffer %s: assigned %s; nothing to recover (no record at the committed offsets)",
                         self.buffer_id, sorted(tp.partition for tp in tps))
                return
            found = await read_decided(self.ctx.kafka, batches_topic=self.names.batches,
                                       drops_topic=self.names.drops, since_ms=since)
            self.state.remember_decided(found.batched_episodes)
            self.state.remember_decided(found.dropped_episodes, found.incomplete_groups, outcome=Reason.INCOMPLETE)
            n = len(found.batched_episodes) + len(found.dropped_episodes)
            self.counters["recovered_ids"] += n
            log.info("buffer %s: assigned %s; %d decided episodes recovered from %d output records",
                     self.buffer_id, sorted(tp.partition for tp in tps), n, found.records_read)

    # -- accounting ---------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``state`` "ok", or "failing" while an offset gap has been open ``offset_gap_fail_s``; ``reason`` and
        ``gaps`` name each such partition and offset (``buffer/gaps.py``)."""
        return self.gaps.health(time.monotonic())

    def all_counters(self) -> dict[str, int]:
        out = {**self.state.counters, **self.counters}
        out["held"] = self.state.held
        return out

    def _report(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_report < REPORT_EVERY_S:
            return
        self._last_report = now
        self.gaps.check_health(now, again=True)  # a failing health is said again at every report
        if record_metric is None:
            return
        for key, value in self.all_counters().items():
            record_metric(f"buffer/{key}", value, "max")
        record_metric("buffer/health_failing", 1.0 if self.gaps.failing else 0.0, "max")
        if flush_metrics is not None:
            self._reports += 1
            flush_metrics(self._reports)

