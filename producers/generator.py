"""The generator role: prompts in, scored Episodes out, one GRPO group per prompt.

``GeneratorRole(config)`` (``streamforge run generator``) runs one vLLM engine (``producers.engine.Engine``) and

* takes prompts from the Kafka ``prompts`` topic as a member of the ``{prefix}.generators`` consumer group
  (``generator.prompt_source = "topic"``, the default), or from ``feeder.source`` in-process (``"local"``);
* samples ``group_size`` responses per prompt (``group_id = prompt_id``, ``episode_id = f"{group_id}/{i}"``),
  scores each with the configured rewards (``producers.rewards``), and produces the Episodes to the ``episodes``
  topic keyed by ``group_id``; an Episode whose reward raised or timed out goes to the dead-letter topic instead,
  with the reason, and the generator keeps going;
* dead-letters a prompt record that does not decode (the codec's reason) or that no engine can take (reason
  ``invalid``: empty, longer than ``model.max_seq_len`` with ``max_tokens``, token ids outside the vocabulary),
  and keeps going;
* commits a prompt's offset only after every Episode of it was acknowledged by the broker, and only the
  contiguous completed prefix per partition (``producers.flow.OffsetTracker``), so a generator killed mid-prompt
  leaves the prompt to another member of the group;
* stops taking prompts while ``producers.flow.Backpressure`` says so (``max_policy_lag`` against the latest
  PolicyVersion in the NATS KV store) and resumes when a new version is loaded/published;
* follows new policy versions with ``weightsync.receiver.WeightReceiver`` (loaded into the engine via
  ``Engine.swap``); without the weightsync package it keeps its initial weights;
* traces each prompt (``generator.prompt``, child of the feeder's span through the record headers) with child
  spans ``generator.generate``, ``generator.reward`` and ``generator.produce``; the Episodes' headers carry the
  context on to the buffer.

Metrics (``streamforge.metrics.record_metric``, flushed every ``generator.metrics_every_s`` into
``<run_dir>/metrics-<generator id>.jsonl`` with the ``jsonl`` backend): ``generator/tokens_per_s``,
``generator/episodes_per_s``, ``generator/prompts``, ``generator/episodes``, ``generator/policy_version``,
``generator/swaps``, ``generator/in_flight``, ``generator/queue_wait_s``, and per group ``generator/reward_mean``,
``generator/generate_s`` and ``generator/response_tokens``.

Supervised loops (``Service.serve``): ``intake`` (consumes prompts), ``policy`` (watches the store), ``metrics``
and ``weightsync`` (the receiver). A prompt task that fails unexpectedly (engine dead, broker error) makes ``intake``
raise, which stops the role with a clear message. ``drain()`` stops intake, waits for the prompts in flight and
commits them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from typing import Any

import numpy as np
from aiokafka.abc import ConsumerRebalanceListener
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from producers.engine import Completion, Engine, Sampling
from producers.flow import Backpressure, OffsetTracker
from producers.rewards import RewardFailed, RewardSet
from producers.sources import open_source
from producers.tiny_model import ensure_model
from streamforge.config import RunConfig
from streamforge.lifecycle import Service
from streamforge.metrics import flush_metrics, record_metric
from topics.errors import BrokerError, CodecError, StreamforgeError
from topics.kafka import Consumer, DeadLetters, Producer, Received
from topics.nats import PolicyStore, connect
from topics.schemas import Episode, Prompt

log = logging.getLogger("streamforge.generator")
_tracer = trace.get_tracer("streamforge.generator")


def default_generator_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def build_episodes(prompt: Prompt, prompt_tokens: list[int], completions: list[Completion], *, generator_id: str,
                   engine_version: int, queued_s: float) -> list[Episode]:
    """One Episode per completion (rewards not yet filled in); ids are deterministic from the prompt id."""
    out = []
    for c in completions:
        versions = np.asarray(c.versions, dtype=np.int32)
        out.append(Episode(
            episode_id=f"{prompt.prompt_id}/{c.index}", group_id=prompt.prompt_id, group_size=len(completions),
            prompt_id=prompt.prompt_id, task=prompt.task,
            prompt_tokens=np.asarray(prompt_tokens, dtype=np.int32),
            response_tokens=np.asarray(c.token_ids, dtype=np.int32),
            logprobs=np.asarray(c.logprobs, dtype=np.float32), token_versions=versions,
            policy_version=int(versions[0]) if len(versions) else engine_version,
            finish_reason=c.finish_reason, generator_id=generator_id, prompt_text=prompt.text,
            response_text=c.text,
            timings={"queued_s": queued_s, "first_token_s": c.first_token_s, "generate_s": c.generate_s},
        ))
    return out


class _Rebalance(ConsumerRebalanceListener):
    """Consumer-group listener: commit what is finished before partitions go, forget them after."""

    def __init__(self, role: GeneratorRole) -> None:
        self.role = role

    async def on_partitions_revoked(self, revoked: Any) -> None:
        try:
            await self.role._commit()
        except Exception as exc:  # noqa: BLE001 - the group already moved on; the new owner redoes the work
            log.warning("commit before rebalance failed: %s", exc)
        self.role.offsets.forget(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("generator %s assigned %s", self.role.generator_id, sorted(tp.partition for tp in assigned))


class GeneratorRole(Service):
    """See the module docstring. ``engine`` may be injected (tests share one running engine)."""

    name = "generator"

    def __init__(self, config: RunConfig, *, engine: Engine | None = None) -> None:
        super().__init__()
        self.config = config
        self.cfg = config.generator
        self.names = config.names
        self.generator_id = self.cfg.generator_id or default_generator_id()
        self.drain_timeout_s = config.up.drain_timeout_s
        self.engine = engine
        self._own_engine = engine is None
        self.sampling = Sampling(max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature,
                                 top_p=self.cfg.top_p, top_k=self.cfg.top_k)
        self.offsets = OffsetTracker()
        self.backpressure = Backpressure(self.cfg.max_policy_lag, self.cfg.groups_per_version)
        self.rewards: RewardSet | None = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.dead: DeadLetters | None = None
        self.nc: Any = None
        self.store: PolicyStore | None = None
        self.receiver: Any = None  # weightsync.receiver.WeightReceiver when weightsync is installed
        self.tokenizer: Any = None
        self._tasks: set[asyncio.Task] = set()
        self._failure: BaseException | None = None
        self._wake = asyncio.Event()  # set when a slot frees, a version arrives, or a task fails
        self._intake_closed = False
        self._commit_lock = asyncio.Lock()
        self.stats = {"prompts": 0, "episodes": 0, "dead_lettered": 0, "tokens": 0, "commits": 0}
        self.first_taken_at: float | None = None  # perf_counter() of the first prompt taken (benchmarks)
        self._last_report = (dict(self.stats), time.perf_counter())  # for the rates of the next metrics row
        self._reports = 0
        self._dead_commit_at = 0.0  # monotonic time of the last commit after a dead-lettered prompt
        self._dead_acks: list[asyncio.Future] = []  # dead letters sent, not yet awaited (before any commit)
        self._vocab: int | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def _start(self) -> None:
        try:
            await self._open()
        except BaseException:
            await self._stop()  # close whatever was opened before the failure
            raise

    async def _open(self) -> None:
        self.rewards = RewardSet(self.cfg.rewards, self.cfg.reward_weights, timeout_s=self.cfg.reward_timeout_s,
                                 max_workers=min(32, 2 * self.cfg.group_size))
        if self.engine is None:
            model = ensure_model(self.config.model.path, self.config.run_dir, seed=self.config.run.seed,
                                 source=self.config.model.source, cache_dir=self.config.model.cache_dir)
            self.engine = Engine(
                str(model), max_model_len=self.config.model.max_seq_len, seed=self.cfg.seed,
                kv_cache_gib=self.cfg.kv_cache_gib, gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                enforce_eager=self.cfg.enforce_eager, logprobs_mode=self.cfg.logprobs_mode,
                extra_args=_weightsync_args(self.config),
            )
        await self.engine.start()  # first: it blocks the loop for ~15 s on CPU
        self.tokenizer = self.engine.tokenizer
        self.producer = Producer(self.config.kafka, client_id=f"generator-{self.generator_id}")
        await self.producer.start()
        self.dead = DeadLetters(self.producer, self.names, role=f"generator:{self.generator_id}")
        self.nc = await connect(self.config.nats, name=f"generator-{self.generator_id}")
        self.store = PolicyStore(self.nc, self.names, history=self.config.nats.kv_history,
                                 timeout_s=self.config.nats.request_timeout_s)
        await self.store.start()
        self.receiver = _make_receiver(self.config, self.engine, self.nc, self.generator_id)
        if self.receiver is not None:
            await self.receiver.start()
        if self.cfg.prompt_source == "topic":
            self.consumer = Consumer(self.config.kafka, [self.names.prompts], group_id=self.names.generators_group,
                                     expect=Prompt, client_id=f"generator-{self.generator_id}",
                                     listener=_Rebalance(self))
            await self.consumer.start()
        log.info("generator %s started (engine version %d, source %s)", self.generator_id, self.engine.version,
                 self.cfg.prompt_source)

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for closer in (self._close_consumer, self._close_receiver, self._close_producer, self._close_nats):
            t0 = time.monotonic()
            try:
                await closer()
            except Exception as exc:  # noqa: BLE001 - close the rest whatever failed
                log.warning("generator stop: %s: %s", closer.__name__, exc)
            log.info("stop: %s took %.1f s", closer.__name__, time.monotonic() - t0)
        if self.rewards is not None:
            self.rewards.close()
        if self._own_engine and self.engine is not None:
            t0 = time.monotonic()
            await self.engine.stop()
            log.info("stop: engine took %.1f s", time.monotonic() - t0)

    async def _close_consumer(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()

    async def _close_receiver(self) -> None:
        if self.receiver is not None:
            await self.receiver.stop()

    async def _close_producer(self) -> None:
        if self.producer is not None:
            await self.producer.stop()

    async def _close_nats(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await asyncio.wait_for(self.nc.drain(), self.config.nats.request_timeout_s)

    def loops(self) -> dict[str, Any]:
        loops = {"intake": self._intake(), "policy": self._policy(), "metrics": self._metrics()}
        if self.receiver is not None:
            loops["weightsync"] = self.receiver.loop()
        return loops

    async def drain(self) -> None:
        """Stop taking prompts; wait for the ones in flight (their Episodes acked); commit them."""
        self._intake_closed = True
        self._wake.set()
        t0 = time.monotonic()
        if self._tasks:
            log.info("drain: waiting for %d prompts in flight", len(self._tasks))
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._commit()
        self._report()  # the last metrics row holds the final counts
        log.info("drain: done in %.1f s", time.monotonic() - t0)

    # -- loops ----------------------------------------------------------------------------------
    async def _policy(self) -> None:
        """Consumes ``PolicyStore.watch()``; records the latest version for backpressure and wakes intake."""
        assert self.store is not None
        async for pv in self.store.watch(on_bad=self._dead_letter_value):
            self.backpressure.published(pv.version)
            self._wake.set()
        raise StreamforgeError("the policy store watch ended", retriable=True)

    async def _metrics(self) -> None:
        """Every ``metrics_every_s``: rates since the last flush and the engine's state, then flush. Never ends."""
        while True:
            await asyncio.sleep(self.cfg.metrics_every_s)
            self._report()

    def _report(self) -> None:
        """Record the rates since the last report and the engine's state, and flush (one metrics row)."""
        now = time.perf_counter()
        last, t_last = self._last_report
        dt = max(now - t_last, 1e-9)
        record_metric("generator/tokens_per_s", (self.stats["tokens"] - last["tokens"]) / dt)
        record_metric("generator/episodes_per_s", (self.stats["episodes"] - last["episodes"]) / dt)
        record_metric("generator/prompts", self.stats["prompts"], "max")
        record_metric("generator/episodes", self.stats["episodes"], "max")
        record_metric("generator/in_flight", len(self._tasks), "max")
        if self.engine is not None:
            record_metric("generator/policy_version", self.engine.version, "max")
            record_metric("generator/swaps", self.engine.swaps, "max")
        self._reports += 1
        flush_metrics(self._reports)
        self._last_report = (dict(self.stats), now)

    async def _dead_letter_value(self, source: str, value: bytes, exc: CodecError) -> None:
        """A NATS value this generator cannot read (the KV's latest version): dead-lettered with its reason."""
        assert self.dead is not None
        await self.dead.send_undecodable(source, value, exc)
        self.stats["dead_lettered"] += 1

    def _may_take(self) -> int:
        """How many prompts intake may take now (0: wait)."""
        assert self.engine is not None
        if self._intake_closed or not self.backpressure.open(self.engine.version):
            return 0
        n = self.cfg.max_concurrent_prompts - len(self._tasks)
        quota = self.backpressure.quota()
        if quota is not None:
            n = min(n, quota - self.backpressure.taken)
        return max(0, n)

    async def _wait_for_slot(self) -> int:
        """Wait until a slot is free and backpressure is open; raises the failure of a prompt task.

        Waits on ``_wake`` (a prompt finished, a version was published, a task failed). While backpressure is
        closed it also re-checks every ``poll_timeout_ms``: the receiver changes ``engine.version`` without
        telling us, and the quota's liveness guard (``backpressure_stall_s``) is a timeout.
        """
        stalled_since: float | None = None
        while True:
            if self._failure is not None:
                raise self._failure
            n = self._may_take()
            if n:
                return n
            self._wake.clear()
            bp = self.backpressure
            if self._intake_closed or bp.open(self.engine.version):
                await self._wake.wait()  # only a free slot (or stopping) can change anything
                continue
            if bp.ahead() and not self._tasks and not bp.behind(self.engine.version):
                now = time.monotonic()
                stalled_since = stalled_since or now
                if now - stalled_since >= self.cfg.backpressure_stall_s:
                    log.warning("backpressure: no new version for %.0f s with nothing in flight; granting %d "
                                "more prompts (is the buffer dropping whole groups?)",
                                now - stalled_since, bp.groups_per_version)
                    bp.grant()
                    stalled_since = None
                    continue
            else:
                stalled_since = None
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.poll_timeout_ms / 1000)
            except TimeoutError:
                pass

    async def _intake(self) -> None:
        """Consumes prompts (the topic, or the local source) while a slot is free and backpressure is open.

        Waits on ``_wake`` (a prompt finished, a version arrived) when full or throttled, and on the broker for
        new prompts otherwise. Never returns while running; raises if a prompt task failed.
        """
        if self.cfg.prompt_source == "local":
            await self._intake_local()
            return
        assert self.consumer is not None
        paused = False
        while True:
            n = self._may_take()
            if n == 0:
                if not paused:  # keep the group membership alive but stop fetching
                    self.consumer.pause()
                    paused = True
                    if not self._intake_closed and len(self._tasks) < self.cfg.max_concurrent_prompts:
                        log.info("backpressure: %s", self.backpressure.reason(self.engine.version))
                n = await self._wait_for_slot()
            if paused:
                self.consumer.resume()
                paused = False
            records = await self.consumer.getmany(timeout_ms=self.cfg.poll_timeout_ms, max_records=n)
            if self._failure is not None:
                raise self._failure
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

    async def _intake_local(self) -> None:
        """The local source (``feeder.source``): prompts are generated in-process, nothing is committed."""
        source = open_source(self.config.feeder.source, seed=self.config.feeder.seed,
                             num_prompts=self.config.feeder.num_prompts)
        for prompt in source:
            await self._wait_for_slot()
            self._spawn(prompt, self._prompt_tokens(prompt), None, None)
        while True:  # the source is exhausted: the role idles until stopped
            await self._wait_for_slot()
            self._wake.clear()
            await self._wake.wait()

    async def _take(self, rec: Received) -> None:
        """Spawn the prompt's task, or dead-letter the record: undecodable, or a prompt no engine can take."""
        self.offsets.take(rec.tp, rec.offset)
        tokens, detail = ([], "") if rec.error is not None or rec.value is None else self._checked_tokens(rec.value)
        if rec.error is not None or rec.value is None or detail:
            assert self.dead is not None
            # pipelined: a flood of bad records is not one broker round trip each; _commit awaits the acks first
            self._dead_acks.append(await self.dead.send(rec, reason="invalid" if detail else "", detail=detail,
                                                        wait=False))
            self.stats["dead_lettered"] += 1
            self.offsets.done(rec.tp, rec.offset)
            if time.monotonic() - self._dead_commit_at >= 0.5:  # ... and commits at most twice a second
                self._dead_commit_at = time.monotonic()
                await self._commit()
            return
        self._spawn(rec.value, tokens, rec, rec.context)

    def _checked_tokens(self, prompt: Prompt) -> tuple[list[int], str]:
        """A (decodable) prompt's tokens and "", or ([], why the engine cannot take it). Tokenizes once."""
        if not prompt.text and not len(prompt.token_ids):
            return [], f"prompt {prompt.prompt_id!r} is empty"
        try:
            tokens = self._prompt_tokens(prompt)
        except Exception as exc:  # noqa: BLE001 - hostile text the tokenizer rejects
            return [], f"prompt {prompt.prompt_id!r} does not tokenize: {type(exc).__name__}: {exc}"
        if not tokens:
            return [], f"prompt {prompt.prompt_id!r} is empty"
        limit = self.engine.max_model_len if self.engine is not None else self.config.model.max_seq_len
        if len(tokens) + self.cfg.max_tokens > limit:
            return [], (f"prompt {prompt.prompt_id!r}: {len(tokens)} tokens + max_tokens {self.cfg.max_tokens} "
                        f"exceed max_model_len {limit}")
        vocab = self._vocab_size()
        if vocab and (min(tokens) < 0 or max(tokens) >= vocab):
            return [], f"prompt {prompt.prompt_id!r}: token ids outside the vocabulary [0, {vocab})"
        return tokens, ""

    def _vocab_size(self) -> int:
        if self._vocab is None:
            try:
                self._vocab = int(self.engine.llm.model_config.get_vocab_size())
            except Exception:  # noqa: BLE001 - an engine without a model config (tests' fakes): no check
                self._vocab = 0
        return self._vocab

    def _spawn(self, prompt: Prompt, tokens: list[int], rec: Received | None, ctx: Any) -> None:
        if self.first_taken_at is None:
            self.first_taken_at = time.perf_counter()
        self.backpressure.took()
        task = asyncio.create_task(self._process(prompt, tokens, rec, ctx), name=f"prompt {prompt.prompt_id}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            log.error("%s failed: %r", task.get_name(), self._failure)
        self._wake.set()

    # -- one prompt -----------------------------------------------------------------------------
    def _prompt_tokens(self, prompt: Prompt) -> list[int]:
        if len(prompt.token_ids):
            return [int(t) for t in prompt.token_ids]
        return list(self.tokenizer(prompt.text)["input_ids"])

    async def _process(self, prompt: Prompt, tokens: list[int], rec: Received | None, ctx: Any) -> None:
        """Generate from the prompt's ``tokens``, score and produce one group; then mark its offset done and commit."""
        assert self.engine is not None and self.producer is not None and self.rewards is not None
        t_taken = time.time()
        with _tracer.start_as_current_span("generator.prompt", context=ctx, attributes={
                "prompt_id": prompt.prompt_id, "generator_id": self.generator_id, "group_size": self.cfg.group_size}):
            with _tracer.start_as_current_span("generator.generate") as span:
                completions = await self.engine.generate(tokens, self.cfg.group_size, self.sampling,
                                                         request_id=f"{self.generator_id}:{prompt.prompt_id}")
                span.set_attribute("tokens", sum(len(c.token_ids) for c in completions))
            episodes = build_episodes(prompt, tokens, completions, generator_id=self.generator_id,
                                      engine_version=self.engine.version,
                                      queued_s=max(0.0, t_taken - prompt.created_at))
            # score the whole group concurrently (rewards run in threads), then produce in index order
            scored = await asyncio.gather(*(self._score(prompt, ep) for ep in episodes))
            acks = []
            for ep, ok in zip(episodes, scored):
                if not ok:
                    continue
                with _tracer.start_as_current_span("generator.produce", attributes={"episode_id": ep.episode_id}):
                    acks.append(await self.producer.enqueue(self.names.episodes, ep, key=ep.group_id))
            if acks:
                await asyncio.gather(*acks)  # every Episode acknowledged by the broker
            self.stats["prompts"] += 1
            self.stats["episodes"] += len(acks)
            self.stats["tokens"] += sum(len(c.token_ids) for c in completions)
            record_metric("generator/queue_wait_s", max(0.0, t_taken - prompt.created_at))
            record_metric("generator/generate_s", max((c.generate_s for c in completions), default=0.0))
            for ep, ok in zip(episodes, scored):
                if ok:
                    record_metric("generator/reward_mean", ep.reward)
                    record_metric("generator/response_tokens", len(ep.response_tokens))
        if rec is not None:
            self.offsets.done(rec.tp, rec.offset)
            await self._commit()

    async def _score(self, prompt: Prompt, ep: Episode) -> bool:
        """Fill in the Episode's reward; on ``RewardFailed`` dead-letter it and return False."""
        assert self.rewards is not None
        with _tracer.start_as_current_span("generator.reward", attributes={"episode_id": ep.episode_id}) as span:
            try:
                scored = await self.rewards.score(prompt, ep.response_text)
            except RewardFailed as exc:
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                await self._dead_letter_episode(ep, exc)
                return False
        ep.reward, ep.reward_components = scored.reward, scored.components
        ep.timings["reward_s"] = scored.seconds
        ep.validate()
        return True

    async def _dead_letter_episode(self, ep: Episode, exc: RewardFailed) -> None:
        assert self.dead is not None
        await self.dead.send_message(self.names.episodes, ep, reason=exc.reason, detail=str(exc))
        self.stats["dead_lettered"] += 1

    async def _commit(self) -> None:
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


def _weightsync_args(config: RunConfig) -> dict[str, Any]:
    try:
        from weightsync import vllm_args
    except ImportError:
        return {}
    return vllm_args(config.weightsync)


def _make_receiver(config: RunConfig, engine: Engine, nc: Any, generator_id: str) -> Any:
    """The weight receiver, or None if the weightsync package is not installed."""
    try:
        from weightsync.receiver import WeightReceiver
    except ImportError:
        log.warning("weightsync is not importable: this generator keeps its initial weights")
        return None
    return WeightReceiver(config.weightsync, engine=engine, nc=nc, names=config.names, generator_id=generator_id)


def main(argv: list[str] | None = None) -> int:
    """``python -m producers.generator [--config C] [--section.key=value ...]``: one generator process."""
    from streamforge.config import load_config
    from streamforge.lifecycle import run_service
    from streamforge.telemetry import setup_tracing, shutdown_tracing

    args = list(sys.argv[1:] if argv is None else argv)
    path = None
    if "--config" in args:
        i = args.index("--config")
        path = args[i + 1]
        del args[i:i + 2]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(path, args)
    setup_tracing("generator", config.run_dir, exporter=config.telemetry.traces,
                  otlp_endpoint=config.telemetry.otlp_endpoint)
    try:
        return run_service(GeneratorRole(config))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    sys.exit(main())
