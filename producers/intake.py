"""The generator's intake: prompts in under backpressure, one task per prompt, and offset commits.

``Intake.loop()`` takes prompts from the Kafka ``prompts`` topic as a member of the ``{prefix}.generators`` group
(or from a local source, ``generator.prompt_source = "local"``) while a slot is free (``max_concurrent_prompts``)
and ``producers.flow.Backpressure`` is open, and runs each through the ``PromptPipeline`` as a task of its own.

* A record that does not decode (the codec's reason) or that no engine can take (reason ``invalid``,
  ``producers/prompts.py``) is dead-lettered, pipelined, and intake goes on.
* A prompt's offset is committed only after every Episode of it was acknowledged by the broker (or, when every
  episode was dead-lettered, its ``UnansweredPrompt``: the pipeline's ``record_unanswered``), and only the
  contiguous completed prefix per partition (``producers.flow.OffsetTracker``), so a generator killed mid-prompt
  leaves the prompt to another member of the group. Before partitions are revoked what is finished is committed.
  The commits run in the background, one at a time, each covering every prompt finished before it: a prompt's
  slot frees once its Episodes are acknowledged, without a commit round trip of its own.
* While backpressure is closed the consumer is paused (the group membership stays alive) and records fetched
  meanwhile are given back by seeking to them.
* A prompt task that fails unexpectedly (engine dead, broker error) makes ``loop()`` raise, which stops the role.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka.abc import ConsumerRebalanceListener

from producers.config import FeederConfig, GeneratorConfig
from producers.flow import Backpressure, OffsetTracker
from producers.prompts import PromptChecker
from producers.sources import open_source
from topics.errors import BrokerError
from topics.kafka import Consumer, DeadLetters, Received
from topics.schemas import Prompt

log = logging.getLogger("streamforge.generator")

# (prompt, its tokens, its trace context, (partition, offset) on the prompts topic or None from a local source):
# returns once its group's Episodes, or the record of why it has none, are on the broker
RunPrompt = Callable[[Prompt, list[int], Any, tuple[int, int] | None], Awaitable[None]]


class Rebalance(ConsumerRebalanceListener):
    """Consumer-group listener: commit what is finished before partitions go, forget them after."""

    def __init__(self, intake: Intake, generator_id: str) -> None:
        self.intake = intake
        self.generator_id = generator_id

    async def on_partitions_revoked(self, revoked: Any) -> None:
        try:
            await self.intake.commit()
        except Exception as exc:  # noqa: BLE001 - the group already moved on; the new owner redoes the work
            log.warning("commit before rebalance failed: %s", exc)
        self.intake.offsets.forget(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("generator %s assigned %s", self.generator_id, sorted(tp.partition for tp in assigned))


class Intake:
    """See the module docstring. ``engine_version()`` is the version of the weights generating now."""

    def __init__(self, cfg: GeneratorConfig, *, backpressure: Backpressure, checker: PromptChecker,
                 run_prompt: RunPrompt, dead: DeadLetters, engine_version: Callable[[], int],
                 stats: dict[str, int], offsets: OffsetTracker | None = None,
                 local_source: FeederConfig | None = None) -> None:
        self.cfg = cfg
        self.backpressure = backpressure
        self.checker = checker
        self.run_prompt = run_prompt
        self.dead = dead
        self.engine_version = engine_version
        self.stats = stats
        self.local_source = local_source
        self.consumer: Consumer | None = None
        self.offsets = offsets if offsets is not None else OffsetTracker()
        self.tasks: set[asyncio.Task] = set()
        self.failure: BaseException | None = None
        self.first_taken_at: float | None = None  # perf_counter() of the first prompt taken (benchmarks)
        self._wake = asyncio.Event()  # set when a slot frees, a version arrives, or a task fails
        self._closed = False
        self._commit_lock = asyncio.Lock()
        self._committer: asyncio.Task | None = None  # the background commits of finished prompts (_commit_soon)
        self._commit_wanted = False
        self._dead_commit_at = 0.0  # monotonic time of the last commit after a dead-lettered prompt
        self._dead_acks: list[asyncio.Future] = []  # dead letters sent, not yet awaited (before any commit)

    # -- what the role tells it ------------------------------------------------------------------
    def published(self, version: int, step: int | None = None) -> None:
        """A new PolicyVersion (of trainer step ``step``) was published: backpressure may open."""
        self.backpressure.published(version, step, time.monotonic())
        self._wake.set()

    def adopted(self, version: int) -> None:
        """The engine now generates with ``version`` (a swap or relabel): backpressure may open."""
        self._wake.set()

    def progressed(self, step: int, version: int | None = None, groups: int = -1) -> None:
        """The trainer has trained ``step`` steps (``groups`` groups), with ``version``: the quota may open."""
        self.backpressure.progressed(step, version, groups)
        self._wake.set()

    def close(self) -> None:
        """Take no more prompts (drain)."""
        self._closed = True
        self._wake.set()

    async def finish_tasks(self) -> None:
        """Wait for every prompt in flight (their Episodes acked or dead-lettered) and the commits they asked for."""
        if self.tasks:
            log.info("drain: waiting for %d prompts in flight", len(self.tasks))
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
        if self._committer is not None:
            await asyncio.gather(self._committer, return_exceptions=True)

    async def cancel_tasks(self) -> None:
        tasks = [*self.tasks, *([self._committer] if self._committer is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the loop --------------------------------------------------------------------------------
    def _may_take(self) -> int:
        """How many prompts intake may take now (0: wait)."""
        if self._closed or not self.backpressure.open(self.engine_version()):
            return 0
        n = self.cfg.max_concurrent_prompts - len(self.tasks)
        quota = self.backpressure.quota()
        if quota is not None:
            n = min(n, quota - self.backpressure.taken)
        return max(0, n)

    async def _wait_for_slot(self) -> int:
        """Wait until a slot is free and backpressure is open; raises the failure of a prompt task.

        Waits on ``_wake`` (a prompt finished, a version was published or adopted by the engine, a task failed).
        While backpressure is closed it also re-checks every ``poll_timeout_ms``: the quota's liveness guard
        (``Backpressure.stall_s()``) is a timeout.
        """
        stalled_since: float | None = None
        while True:
            if self.failure is not None:
                raise self.failure
            n = self._may_take()
            if n or self._closed:
                return n
            self._wake.clear()
            bp = self.backpressure
            if bp.open(self.engine_version()):
                await self._wake.wait()  # only a free slot (or stopping) can change anything
                continue
            if bp.ahead() and not self.tasks and not bp.behind(self.engine_version()):
                now = time.monotonic()
                stalled_since = stalled_since or now
                if now - stalled_since >= bp.stall_s():
                    log.warning("backpressure: no new version for %.0f s with nothing in flight; granting %d "
                                "more prompts (is the buffer dropping whole groups?)",
                                now - stalled_since, max(1, math.ceil(bp.groups_per_step)))
                    bp.grant()
                    stalled_since = None
                    continue
            else:
                stalled_since = None
            try:  # asyncio.timeout, not wait_for: wait_for can swallow a cancellation that races the event
                async with asyncio.timeout(self.cfg.poll_timeout_ms / 1000):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def loop(self) -> None:
        """Consumes prompts (the topic, or the local source) while a slot is free and backpressure is open.

        Waits on ``_wake`` (a prompt finished, a version arrived) when full or throttled, and on the broker for
        new prompts otherwise. Returns only once closed (the role drains); raises if a prompt task failed.
        """
        if self.consumer is None:
            await self._loop_local()
            return
        paused = False
        while True:
            n = self._may_take()
            if n == 0:
                if not paused:  # keep the group membership alive but stop fetching
                    self.consumer.pause()
                    paused = True
                    if not self._closed and len(self.tasks) < self.cfg.max_concurrent_prompts:
                        log.info("backpressure: %s", self.backpressure.reason(self.engine_version()))
                n = await self._wait_for_slot()
                if self._closed:
                    return
            if paused:
                self.consumer.resume()
                paused = False
            records = await self.consumer.getmany(timeout_ms=self.cfg.poll_timeout_ms, max_records=n)
            if self.failure is not None:
                raise self.failure
            # Backpressure may have closed while the fetch waited: give back what may not be taken now.
            allowed = self._may_take()
            for rec in records[:allowed]:
                await self._take(rec)
            self._give_back(records[allowed:])

    def _give_back(self, records: list[Received]) -> None:
        """Seek each partition back to its first record not taken, so the next fetch returns it again."""
        assert self.consumer is not None
        first: dict[Any, int] = {}
        for rec in records:
            first[rec.tp] = min(first.get(rec.tp, rec.offset), rec.offset)
        for tp, offset in first.items():
            self.consumer.seek(tp, offset)

    async def _loop_local(self) -> None:
        """The local source (``feeder.source``): prompts are generated in-process, nothing is committed."""
        src = self.local_source or FeederConfig()
        for prompt in open_source(src.source, seed=src.seed, num_prompts=src.num_prompts):
            await self._wait_for_slot()
            if self._closed:
                return
            self._spawn(prompt, self.checker.tokens(prompt), None, None)
        while not self._closed:  # the source is exhausted: the role idles until stopped
            await self._wait_for_slot()
            self._wake.clear()
            if not self._closed:
                await self._wake.wait()

    async def _take(self, rec: Received) -> None:
        """Spawn the prompt's task, or dead-letter the record: undecodable, or a prompt no engine can take."""
        self.offsets.take(rec.tp, rec.offset)
        tokens, detail = ([], "") if rec.error is not None or rec.value is None else self.checker.check(rec.value)
        if rec.error is not None or rec.value is None or detail:
            # pipelined: a flood of bad records is not one broker round trip each; commit awaits the acks first
            self._dead_acks.append(await self.dead.send(rec, reason="invalid" if detail else "", detail=detail,
                                                        wait=False))
            self.stats["dead_lettered"] += 1
            self.offsets.done(rec.tp, rec.offset)
            if time.monotonic() - self._dead_commit_at >= 0.5:  # ... and commits at most twice a second
                self._dead_commit_at = time.monotonic()
                await self.commit()
            return
        self._spawn(rec.value, tokens, rec, rec.context)

    def _spawn(self, prompt: Prompt, tokens: list[int], rec: Received | None, ctx: Any) -> None:
        if self.first_taken_at is None:
            self.first_taken_at = time.perf_counter()
        self.backpressure.took()
        task = asyncio.create_task(self._process(prompt, tokens, rec, ctx), name=f"prompt {prompt.prompt_id}")
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
            log.error("%s failed: %r", task.get_name(), self.failure)
        self._wake.set()

    async def _process(self, prompt: Prompt, tokens: list[int], rec: Received | None, ctx: Any) -> None:
        await self.run_prompt(prompt, tokens, ctx, (rec.partition, rec.offset) if rec is not None else None)
        if rec is not None:
            self.offsets.done(rec.tp, rec.offset)
            self._commit_soon()

    def _commit_soon(self) -> None:
        """Commit what is done in the background: a prompt's slot frees once its Episodes are acknowledged, not
        after a commit round trip of its own, and the prompts that finish while a commit is in flight share the
        next one. A commit that raises fails intake, as a failed prompt does."""
        self._commit_wanted = True
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_loop(), name="prompt commits")
            self._committer.add_done_callback(self._task_done)

    async def _commit_loop(self) -> None:
        """Commits until no prompt finished during the last commit (``_commit_soon`` restarts it)."""
        while self._commit_wanted:
            self._commit_wanted = False
            await self.commit()

    # -- commits ---------------------------------------------------------------------------------
    async def commit(self) -> None:
        """Commit the contiguous completed prefix of every partition (serialised)."""
        if self.consumer is None:
            return
        async with self._commit_lock:
            # both taken with no await between: every record in `offsets` had its dead letter (if any) in `acks`
            acks, self._dead_acks = self._dead_acks, []
            offsets = self.offsets.committable()
            if acks:  # a record is committed only once its dead letter is on the broker
                await asyncio.gather(*acks)
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
