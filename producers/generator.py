"""The generator role: prompts in, scored Episodes out, one GRPO group per prompt.

``GeneratorRole(cfg, ctx, weightsync=...)`` (``streamforge run generator``) runs one vLLM engine
(``producers.engine.Engine``) and wires together

* its intake (``producers/intake.py``): prompts from the Kafka ``prompts`` topic as a member of the
  ``{prefix}.generators`` consumer group (``generator.prompt_source = "topic"``, the default), or from a local
  source in-process (``"local"``), under backpressure, with offsets committed only once a prompt's Episodes are
  on the broker; undecodable or invalid prompts (``producers/prompts.py``) are dead-lettered;
* the per-prompt pipeline (``producers/pipeline.py``): ``group_size`` samples, rewards (``producers.rewards``),
  Episodes to the ``episodes`` topic keyed by ``group_id``, a failed reward's Episode dead-lettered (a prompt left
  with no Episode is recorded, with the reasons, on ``unanswered`` before its offset is committed); or, with an
  environment (``env.name``), the multi-turn loop (``producers/multiturn.py``) against its replicas, found on
  NATS (``envs/routing.py``);
* backpressure (``producers.flow.Backpressure``): no new prompt while its weights are more than
  ``max_policy_lag`` versions behind the latest PolicyVersion in the NATS KV store, nor beyond its quota of
  ``groups_per_step`` groups per trainer step (``quota_window_steps`` steps ahead); it resumes when a new version
  is loaded or published;
* weight sync: ``weightsync.receiver.WeightReceiver`` loads new versions into the engine (``Engine.swap``).

Metrics (``runtime.metrics.record_metric``, flushed every ``generator.metrics_every_s`` into
``<run_dir>/metrics-<generator id>.jsonl`` with the ``jsonl`` backend): ``generator/tokens_per_s``,
``generator/episodes_per_s``, ``generator/prompts``, ``generator/episodes``, ``generator/policy_version``,
``generator/swaps``, ``generator/in_flight``, ``generator/quota_refunds``, ``generator/queue_wait_s``, and per
group ``generator/reward_mean``,
``generator/generate_s`` and ``generator/response_tokens``; with an environment also ``generator/env/turns``,
``generator/env/tool_calls`` per episode and the outcome counters ``generator/env/<outcome>`` (``done``,
``rejected``, ``truncated``, ``restarts``, ``replica_lost``... see ``producers/multiturn.py``).

Supervised loops (``Service.serve``): ``intake`` (consumes prompts), ``policy`` and ``progress`` (watch the
store's latest version and the trainer's steps), ``metrics`` and ``weightsync`` (the receiver). A prompt task that fails unexpectedly (engine dead, broker error) makes ``intake``
raise, which stops the role with a clear message. ``drain()`` stops intake, waits for the prompts in flight and
commits them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from envs.config import EnvConfig
from envs.routing import ServiceEnvRouter
from models.tiny_model import ensure_model
from producers import vllm_fork
from producers.config import FeederConfig, GeneratorConfig
from producers.engine import Engine, Sampling, check_block_size
from producers.flow import Backpressure, OffsetTracker, quota_phase
from producers.intake import Intake, Rebalance
from producers.multiturn import MultiTurnPipeline, TurnRenderer
from producers.pipeline import PromptPipeline
from producers.prompts import PromptChecker
from producers.refunds import DropRefunds
from producers.rewards import RewardSet
from runtime.context import RoleContext
from runtime.cpus import available, pin
from runtime.lifecycle import Service
from runtime.metrics import flush_metrics, record_metric
from runtime.services import ServiceDirectory
from topics.deadlines import within
from topics.errors import CodecError, StreamforgeError
from topics.kafka import Consumer, DeadLetters, Producer
from topics.nats import PolicyStore, connect
from topics.schemas import Prompt
from weightsync.config import WeightSyncConfig

log = logging.getLogger("streamforge.generator")


def default_generator_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class GeneratorRole(Service):
    """See the module docstring. ``engine`` may be injected (tests share one running engine); ``local_source``
    is the in-process prompt source of ``prompt_source = "local"`` (the run's ``feeder`` section)."""

    name = "generator"

    def __init__(self, cfg: GeneratorConfig, ctx: RoleContext, *, weightsync: WeightSyncConfig | None = None,
                 local_source: FeederConfig | None = None, engine: Engine | None = None,
                 env: EnvConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.env = env if env is not None and env.name else None  # multi-turn episodes against this environment
        self.ctx = ctx
        self.weightsync = weightsync
        self.local_source = local_source
        self.names = ctx.names
        self.generator_id = cfg.generator_id or default_generator_id()
        self.drain_timeout_s = ctx.drain_timeout_s
        self.engine = engine
        self._own_engine = engine is None
        self.sampling = Sampling(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                 top_k=cfg.top_k)
        self.backpressure = Backpressure(cfg.max_policy_lag, cfg.groups_per_step, cfg.quota_window_steps,
                                         stall_s_config=cfg.backpressure_stall_s,
                                         count_zero_variance=cfg.quota_counts_zero_variance,
                                         phase=quota_phase(self.generator_id),
                                         groups_per_batch=cfg.quota_groups_per_batch)
        self.offsets = OffsetTracker()  # the intake's: which prompt offsets may be committed
        self.rewards: RewardSet | None = None
        self.producer: Producer | None = None
        self.dead: DeadLetters | None = None
        self.intake: Intake | None = None
        self.nc: Any = None
        self.store: PolicyStore | None = None
        self.services: ServiceDirectory | None = None  # with remote rewards: the live view of the service replicas
        self.receiver: Any = None  # weightsync.receiver.WeightReceiver when weightsync is configured
        self._unwatch_version: Callable[[], None] | None = None  # stops the engine's calls to intake.adopted
        self.refunds: DropRefunds | None = None  # with a quota: groups the buffer dropped give it back
        self.tokenizer: Any = None
        self.stats = {"prompts": 0, "episodes": 0, "dead_lettered": 0, "tokens": 0, "commits": 0}
        self._last_report = (dict(self.stats), time.perf_counter())  # for the rates of the next metrics row
        self._reports = 0

    # -- views of the intake (tests and benchmarks read them) ----------------------------------------
    @property
    def consumer(self) -> Consumer | None:
        return self.intake.consumer if self.intake is not None else None

    @property
    def first_taken_at(self) -> float | None:
        return self.intake.first_taken_at if self.intake is not None else None

    # -- lifecycle ------------------------------------------------------------------------------
    def own_process(self) -> None:
        """This process is the generator's: its engine's processes may be forked (``producers/vllm_fork.py``)."""
        vllm_fork.own_process()

    async def _start(self) -> None:
        try:
            await self._open()
        except BaseException:
            await self._stop()  # close whatever was opened before the failure
            raise

    async def _open(self) -> None:
        ctx, cfg = self.ctx, self.cfg
        self.rewards = RewardSet(cfg.rewards, cfg.reward_weights, timeout_s=cfg.reward_timeout_s,
                                 max_workers=min(32, 2 * cfg.group_size))
        loop_cores = available(cfg.loop_cpus, key="generator.loop_cpus")  # checked before the engine starts
        if self.engine is None:
            if cores := pin(cfg.cpus, key="generator.cpus"):  # before the engine: its processes inherit it
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpus
                log.info("generator %s runs on cores %s", self.generator_id, cores)
            check_block_size(cfg.kv_block_size, "generator.kv_block_size")
            model = ensure_model(ctx.model.path, ctx.run_dir, seed=ctx.run.seed, source=ctx.model.source,
                                 cache_dir=ctx.model.cache_dir)
            self.engine = Engine(
                str(model), max_model_len=ctx.model.max_seq_len, seed=cfg.seed, kv_cache_gib=cfg.kv_cache_gib,
                gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
                logprobs_mode=cfg.logprobs_mode, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                poll_s=None if cfg.vllm_poll_s == -1 else cfg.vllm_poll_s, executor=cfg.engine_executor(),
                start_method=cfg.vllm_start_method, block_size=cfg.kv_block_size,
                extra_args=_weightsync_args(self.weightsync),
            )
        await self.engine.start()  # first: it blocks the loop for ~15 s on CPU
        if loop_cores:  # the engine's processes keep generator.cpus; this one moves
            pin(cfg.loop_cpus, key="generator.loop_cpus", allowed=set(loop_cores))
            log.info("generator %s: its own process runs on cores %s", self.generator_id, loop_cores)
        engine = self.engine
        self.tokenizer = engine.tokenizer
        self.producer = Producer(ctx.kafka, client_id=f"generator-{self.generator_id}")
        await self.producer.start()
        self.dead = DeadLetters(self.producer, self.names, role=f"generator:{self.generator_id}")
        self.nc = await connect(ctx.nats, name=f"generator-{self.generator_id}")
        self.store = PolicyStore(self.nc, self.names, history=ctx.nats.kv_history,
                                 timeout_s=ctx.nats.request_timeout_s)
        await self.store.start()
        if self.rewards.remote or self.env is not None:  # routed by the service layer (runtime/services.py)
            self.services = ServiceDirectory(self.nc, self.names, timeout_s=ctx.nats.request_timeout_s)
            await self.services.start()
            if self.rewards.remote:
                self.rewards.bind(self.services)
        current, _ = await self.store.latest_good(on_bad=self._dead_letter_value)
        progress = await self.store.progress()
        steps = [x.step for x in (current, progress) if x is not None]
        if steps:  # a restart or a late join: the quota counts from the trainer's step (and groups) now
            self.backpressure.started_at(max(steps), progress.groups if progress is not None else None)
        if self.weightsync is not None:
            from weightsync.receiver import WeightReceiver

            self.receiver = WeightReceiver(self.weightsync, engine=engine, nc=self.nc, names=self.names,
                                           generator_id=self.generator_id)
            await self.receiver.start()
        else:
            log.warning("no weightsync section: generator %s keeps its initial weights", self.generator_id)
        if cfg.groups_per_step > 0:
            self.refunds = DropRefunds(ctx.kafka, self.names.drops, refund=self.backpressure.refund,
                                       client_id=f"generator-{self.generator_id}-drops")
            await self.refunds.start()
        checker = PromptChecker(self.tokenizer, max_model_len=getattr(engine, "max_model_len", ctx.model.max_seq_len),
                                max_tokens=cfg.max_tokens,
                                vocab_size=lambda: engine.llm.model_config.get_vocab_size(),
                                chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
        on_produced = self.refunds.produced if self.refunds is not None else None
        if self.env is not None:
            self.pipeline: PromptPipeline | MultiTurnPipeline = MultiTurnPipeline(
                engine=engine, router=ServiceEnvRouter(self.services, self.env), env=self.env,
                renderer=TurnRenderer(self.tokenizer, chat_template=cfg.chat_template, system_prompt=cfg.system_prompt),
                producer=self.producer, dead=self.dead, names=self.names, generator_id=self.generator_id,
                sampling=self.sampling, group_size=cfg.group_size,
                max_seq_len=getattr(engine, "max_model_len", ctx.model.max_seq_len), stats=self.stats,
                on_scored=self.backpressure.scored, on_produced=on_produced)
        else:
            self.pipeline = PromptPipeline(
                engine=engine, rewards=self.rewards, producer=self.producer, dead=self.dead, names=self.names,
                generator_id=self.generator_id, sampling=self.sampling, group_size=cfg.group_size, stats=self.stats,
                on_scored=self.backpressure.scored, on_produced=on_produced)
        pipeline = self.pipeline
        self.intake = Intake(cfg, backpressure=self.backpressure, checker=checker, run_prompt=pipeline.run,
                             dead=self.dead, engine_version=lambda: engine.version, stats=self.stats,
                             offsets=self.offsets, local_source=self.local_source)
        # a swap or relabel may open backpressure (max_policy_lag): without this wake the intake would see the
        # new version only at its next poll_timeout_ms re-check (every step of a sync run waited for it)
        self._unwatch_version = engine.on_version(self.intake.adopted)
        if cfg.prompt_source == "topic":
            self.intake.consumer = Consumer(ctx.kafka, [self.names.prompts], group_id=self.names.generators_group,
                                            expect=Prompt, client_id=f"generator-{self.generator_id}",
                                            listener=Rebalance(self.intake, self.generator_id))
            await self.intake.consumer.start()
        log.info("generator %s started (engine version %d, source %s)", self.generator_id, engine.version,
                 cfg.prompt_source)

    async def _stop(self) -> None:
        if self._unwatch_version is not None:
            self._unwatch_version()
            self._unwatch_version = None
        if self.intake is not None:
            await self.intake.cancel_tasks()
        for closer in (self._close_consumer, self._close_refunds, self._close_receiver, self._close_producer,
                       self._close_nats):
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

    async def _close_refunds(self) -> None:
        if self.refunds is not None:
            await self.refunds.stop()

    async def _close_receiver(self) -> None:
        if self.receiver is not None:
            await self.receiver.stop()

    async def _close_producer(self) -> None:
        if self.producer is not None:
            await self.producer.stop()

    async def _close_nats(self) -> None:
        if self.services is not None:
            await self.services.stop()
        if self.nc is not None and not self.nc.is_closed:
            await within(self.nc.drain(), self.ctx.nats.request_timeout_s)

    def loops(self) -> dict[str, Any]:
        assert self.intake is not None
        loops = {"intake": self.intake.loop(), "policy": self._policy(), "progress": self._progress(),
                 "metrics": self._metrics()}
        if self.receiver is not None:
            loops["weightsync"] = self.receiver.loop()
        if self.refunds is not None:
            loops["refunds"] = self.refunds.loop()
        if self.services is not None:
            loops["services"] = self.services.loop()
        return loops

    async def drain(self) -> None:
        """Stop taking prompts; wait for the ones in flight (their Episodes acked); commit them."""
        assert self.intake is not None
        self.intake.close()
        t0 = time.monotonic()
        await self.intake.finish_tasks()
        await self.intake.commit()
        self._report()  # the last metrics row holds the final counts
        log.info("drain: done in %.1f s", time.monotonic() - t0)

    # -- loops ----------------------------------------------------------------------------------
    async def _policy(self) -> None:
        """Consumes ``PolicyStore.watch()``; records the latest version for backpressure and wakes intake."""
        assert self.store is not None and self.intake is not None
        async for pv in self.store.watch(on_bad=self._dead_letter_value):
            self.intake.published(pv.version, pv.step)
        raise StreamforgeError("the policy store watch ended", retriable=True)

    async def _progress(self) -> None:
        """Consumes ``PolicyStore.watch_progress()`` (the trainer's steps, after every step): the quota follows
        what the trainer has trained, not only what it has published."""
        assert self.store is not None and self.intake is not None
        async for progress in self.store.watch_progress(on_bad=self._dead_letter_value):
            self.intake.progressed(progress.step, progress.version, progress.groups)
        raise StreamforgeError("the trainer-progress watch ended", retriable=True)

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
        record_metric("generator/in_flight", len(self.intake.tasks) if self.intake is not None else 0, "max")
        record_metric("generator/quota_refunds", self.backpressure.refunded, "max")
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


def _weightsync_args(cfg: WeightSyncConfig | None) -> dict[str, Any]:
    if cfg is None:
        return {}
    from weightsync import vllm_args

    return vllm_args(cfg)
