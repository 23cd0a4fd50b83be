"""``streamforge run trainer``: Kafka-driven continuous training (RL on ``batches``, or SFT on ``sft``).

Per step (rank 0): take the next record of the topic (``source.py``: explicit offsets, dead-letters for
undecodable records), drop it if its ``batch_id`` was already trained (redelivery), broadcast it to the other ranks
(``engine.py``), step (loss, backward, clip, AdamW, schedule), append the ledger line and the metrics row, then
every ``publish_every`` steps hand the weights to the ``WeightPublisher`` (new ``PolicyVersion``; the round
overlaps the next step, at most one round in flight: with ``publish_busy: skip`` a publication due while a round
is in flight is put off until it ended, so the trainer never waits for generators' swaps) and every
``checkpoint_every`` steps write a checkpoint (model, optimizer, step, version, offsets, recent batches, HF export).

Restart: the newest checkpoint is loaded, the ledger and metrics lose their lines after its step, and reading
resumes at its offsets: the batches trained after the checkpoint are trained again, exactly once in the ledger.
The policy version continues from ``max(checkpoint version, latest version in the KV store)`` so versions never
go backwards for the generators.

Stops: ``trainer.max_steps`` steps or a running mean reward over ``reward_window`` batches reaching ``reward_target``
finish the run (exit 0; ``<run_dir>/trainer/done.json`` says why); SIGTERM drains. Either way the in-flight step
completes, a final checkpoint and ``<run_dir>/hf`` are written and the last publication round is awaited.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import orjson
import torch
from opentelemetry import trace

from consumers.checkpoint import CheckpointMeta
from consumers.config import TrainerConfig
from consumers.engine import EXPORT, PUBLISH, QUIT, Commander, TrainEngine, follow, max_staleness, staleness
from consumers.ledger import ALREADY_TRAINED, STALE, JsonlAppender, Ledger, TrainedEpisodes, truncate_metrics_after
from consumers.parallel import Dist, close_distributed, init_distributed
from consumers.sft import collate_sft
from models.tiny_model import ensure_model
from runtime.context import RoleContext
from runtime.cpus import pin
from runtime.lifecycle import Service
from runtime.malloc import keep_freed_memory
from runtime.metrics import flush_metrics, record_metric
from topics.deadlines import within
from topics.errors import ConfigError, RoleCrashed
from topics.kafka import DeadLetters, Producer, Received
from topics.schemas import Batch, SFTExample, TrainerProgress
from weightsync.config import WeightSyncConfig

log = logging.getLogger("streamforge.trainer")
DONE_FILE = "trainer/done.json"  # written when the run finished by itself (see _write_done)
_tracer = trace.get_tracer("streamforge.trainer")


def _record(metrics: dict[str, Any], step: int) -> None:
    for key, value in metrics.items():
        if isinstance(value, (int, float)):
            record_metric(key if "/" in key else f"trainer/{key}", float(value))
    flush_metrics(step)


class TrainerRole(Service):
    """The trainer process (one per rank under torchrun); see the module docstring."""

    name = "trainer"

    def __init__(self, cfg: TrainerConfig, ctx: RoleContext, *, weightsync: WeightSyncConfig | None = None,
                 temperature: float = 1.0, max_completion_length: int | None = None,
                 max_staleness: int | None = None) -> None:
        """``temperature`` and ``max_completion_length``: the generators' sampling (the logits are scaled the same
        way; some losses normalise by the length); ``max_staleness``: a batch with a token more versions behind
        than this is not trained (``staleness.max_versions``; None = no bound)."""
        super().__init__()
        self.cfg = cfg
        self.ctx = ctx
        self.weightsync = weightsync or WeightSyncConfig()
        self.temperature = temperature
        self.max_completion_length = max_completion_length
        self.max_staleness = max_staleness
        self.names = ctx.names
        self.run_dir = ctx.run_dir
        self.trainer_id = f"trainer-{socket.gethostname()}-{os.getpid()}"  # one per process: a zombie is told apart
        self.drain_timeout_s = self.weightsync.ack_deadline_s + 60.0
        self.d: Dist = Dist()
        self.engine: TrainEngine | None = None
        # every engine call on this one thread: OpenMP keeps a team and jemalloc an arena per calling thread, and a
        # step on a thread new to it (asyncio's default pool takes any idle one) warmed its own again
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trainer-engine")
        self.cmd: Commander | None = None
        self.step = 0
        self.version = 0
        self.groups = 0  # GRPO groups trained over all steps (TrainerProgress.groups); -1 = unknown after a restore
        self.recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.duplicates = 0
        self.trained_episodes = TrainedEpisodes(self.cfg.dedup_window)  # refuses a zombie buffer's batch
        self.refused = 0
        self.stale_batches = 0  # batches not trained: a token older than max_staleness when their turn came
        self._progress_due: TrainerProgress | None = None
        self._progress_task: asyncio.Task | None = None
        self._since_publish: list[str] = []
        self._rewards: collections.deque[float] = collections.deque(maxlen=self.cfg.reward_window)
        self._checkpointed_step = -1
        self._stop_event: asyncio.Event | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._quit_sent = False
        self._round: asyncio.Task | None = None
        self._published_step = 0  # the step of the latest publication (or of the checkpoint resumed from)
        self._t0 = time.time()
        self.source = None
        self.producer: Producer | None = None
        self.publisher = None
        self.nc = None
        self.ledger: Ledger | None = None
        self.metrics_out: JsonlAppender | None = None
        self._drops: dict[str, dict[str, float]] = {}  # buffer id -> its drop counters (from its latest batch)
        self._env_restarts: dict[str, float] = {}  # buffer id -> env/restarts (from its latest batch)
        self.tokenizer = None
        self.finished_reason = ""

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def own_process(self) -> None:
        """Its own process: glibc keeps freed memory, so a snapshot reuses the last one's pages (runtime/malloc.py)."""
        keep_freed_memory()

    async def serve(self, stop: asyncio.Event | None = None, *, freeze_heap: bool = False,
                    on_crash: Callable[[RoleCrashed], None] | None = None) -> None:
        self._stop_event = stop or asyncio.Event()
        await super().serve(self._stop_event, freeze_heap=freeze_heap, on_crash=on_crash)

    async def _start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cores = pin(self.cfg.cpus, key="trainer.cpus")
        if self.cfg.threads or cores:
            torch.set_num_threads(self.cfg.threads or len(cores))
        self.d = init_distributed()
        if self.cfg.world_size != self.d.world_size:
            raise ConfigError("trainer.world_size", f"is {self.cfg.world_size} but this process is one of "
                              f"{self.d.world_size} ranks: launch N ranks with `torchrun --nproc-per-node N -m "
                              f"streamforge run trainer --trainer.world_size=N ...`")
        self.cmd = Commander(self.d)
        m = self.ctx.model
        model_dir = await asyncio.to_thread(ensure_model, m.path, self.run_dir, seed=self.ctx.run.seed,
                                            source=m.source, cache_dir=m.cache_dir)
        self.engine = await self._on_engine(
            TrainEngine, self.cfg, model_dir=model_dir, run_dir=self.run_dir, d=self.d, max_seq_len=m.max_seq_len,
            temperature=self.temperature, max_completion_length=self.max_completion_length)
        meta = await self._on_engine(self.engine.restore)
        offsets: dict[str, int] = {}
        if meta is not None:
            self.step, self.version, offsets = meta.step, meta.policy_version, dict(meta.offsets)
            self.groups = meta.groups
            self.recent.update((b, None) for b in meta.recent_batch_ids)
            self._checkpointed_step = self._published_step = meta.step
            log.info("trainer resumed from step %d (version %d) at offsets %s", self.step, self.version, offsets)
        if not self.d.is_main:
            return
        (self.run_dir / DONE_FILE).unlink(missing_ok=True)  # written again when this run finishes
        removed = Ledger.truncate_after(self.run_dir, self.step)
        truncate_metrics_after(self.run_dir / "metrics.jsonl", self.step)
        if removed:
            log.info("ledger: %d steps after the checkpoint will be trained again", removed)
        self.ledger = Ledger(self.run_dir)
        self.trained_episodes.load(Ledger.read(self.run_dir))
        self.metrics_out = JsonlAppender(self.run_dir / "metrics.jsonl")
        if self.cfg.mode == "sft":
            from models.tiny_model import load_tokenizer

            self.tokenizer = load_tokenizer(model_dir)
        self.producer = Producer(self.ctx.kafka, client_id="trainer")
        await self.producer.start()
        from consumers.source import RecordSource

        rl = self.cfg.mode == "rl"
        dead = DeadLetters(self.producer, self.names, "trainer")
        self.source = RecordSource(self.ctx.kafka, self.names.batches if rl else self.names.sft,
                                   group_id=self.names.trainers_group, expect=Batch if rl else SFTExample,
                                   dead_letters=dead)
        await self.source.start(offsets)
        if self.ctx.nats.url:
            from topics.nats import connect
            from weightsync.publisher import WeightPublisher

            self.nc = await connect(self.ctx.nats, name="trainer")
            self.publisher = WeightPublisher(self.weightsync, nc=self.nc, names=self.names,
                                             run_dir=self.run_dir, trainer_id=self.trainer_id)
            self.publisher.on_bad = dead.send_undecodable  # undecodable membership and ack messages
            await self.publisher.start()
            if self.publisher.latest_version > self.version:
                log.info("policy versions continue after the store's %d", self.publisher.latest_version)
                self.version = self.publisher.latest_version
            self._report_progress()  # a restarted trainer says where it resumes
        else:
            log.warning("nats.url is empty: the trainer publishes no policy versions")

    async def _on_engine(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the engine's thread (see ``_compute``), awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, lambda: fn(*args, **kwargs))

    async def _stop(self) -> None:
        for closer in (self._close_round, self._close_clients):
            try:
                await closer()
            except Exception as exc:  # noqa: BLE001 - stopping must not hide the original failure
                log.warning("trainer stop: %s", exc)
        self._compute.shutdown(wait=False)
        if self.d.enabled:
            if self._quit_sent:  # a clean end on every rank: barrier, then leave together
                close_distributed(self.d)
            else:  # a crash: never wait on peers (torchrun stops the other ranks when this one exits non-zero)
                import torch.distributed as dist

                dist.destroy_process_group()

    async def _close_round(self) -> None:
        if self._round is not None and not self._round.done():
            await within(asyncio.shield(self._round), self.weightsync.ack_deadline_s + 5)
        if self._progress_task is not None and not self._progress_task.done():
            await within(self._progress_task, self.weightsync.timeout_s + 1)

    async def _close_clients(self) -> None:
        for client in (self.publisher, self.source, self.producer):
            if client is not None:
                await client.stop()
        if self.nc is not None:
            await self.nc.close()
        for fh in (self.ledger, self.metrics_out):
            if fh is not None:
                fh.close()

    def loops(self) -> dict[str, Any]:
        if self.d.is_main:
            return {"train": self._train_loop()}
        return {"follow": self._follow_loop()}

    async def drain(self) -> None:
        """Let the in-flight step finish, then checkpoint, export, finish the publication round, release ranks."""
        if not self.d.is_main:
            while not self._quit_sent:  # a follower leaves when rank 0 says so
                await asyncio.sleep(0.1)
            return
        await self._idle.wait()
        if self.step > 0 and self._checkpointed_step != self.step:
            await self._checkpoint()
        if self.step > 0 and self.cfg.export_hf:
            self.cmd.send(EXPORT)
            await self._on_engine(self.engine.export)
        await self._close_round()
        if self._round is not None and self._round.done() and not self._round.cancelled() and self._round.exception():
            log.error("last publication round failed: %s", self._round.exception())
        self.cmd.send(QUIT)
        self._quit_sent = True

    def _write_done(self, reason: str) -> None:
        """``<run_dir>/trainer/done.json``: the run reached its end (``max_steps`` or ``reward_target``), and why.
        ``up`` counts a trainer that exits 0 without it as a run that did not finish."""
        path = self.run_dir / DONE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps({"reason": reason, "step": self.step, "policy_version": self.version,
                                       "time": time.time()}))

    def _finish(self, reason: str) -> None:
        log.info("trainer finished: %s", reason)
        self.finished_reason = reason
        assert self._stop_event is not None
        self._stop_event.set()

    # -- loops --------------------------------------------------------------------------------------------------
    async def _follow_loop(self) -> None:
        """Follower ranks: replay rank 0's collective calls (blocking broadcasts, in a thread) until QUIT; then
        stop the role. Unblocked only by rank 0."""
        await self._on_engine(follow, self.engine)
        self._quit_sent = True
        self._finish("rank 0 quit")
        await asyncio.Event().wait()

    async def _train_loop(self) -> None:
        """Consumes the batches (or sft) topic one batch per step; waits on Kafka for at most ``poll_timeout_ms``
        at a time, then re-checks for stop. Unblocked by a record, or by stop. Ends the run itself (sets the stop
        event, then idles until cancelled) when ``max_steps`` or ``reward_target`` is reached."""
        while not self.stopping:
            done = self._done_reason()
            if done:
                self._write_done(done)
                self._finish(done)
                break
            batch, records = await self._next_batch()
            if batch is None and not self.stopping and self._owed() and self._publish_due():
                self._idle.clear()  # a publication put off while a round was in flight: the round ended
                try:
                    await self._publish()
                finally:
                    self._idle.set()
            if batch is None or self.stopping:
                continue  # records stay unaccounted: a restart reads them again
            if batch.batch_id in self.recent:
                self.duplicates += 1
                log.info("batch %s was already trained: skipped", batch.batch_id)
                for rec in records:
                    self.source.advance(rec)
                self._report_progress()
                continue
            again = self.trained_episodes.trained(batch.episode_ids) if self.cfg.mode == "rl" else {}
            problem = self._unusable(batch) if not again else (
                f"batch {batch.batch_id}: {len(again)} of its {len(batch.episode_ids)} episodes were already "
                f"trained (e.g. {min(again)} at step {again[min(again)]}): a batch of a zombie buffer")
            reason = ALREADY_TRAINED if again else "invalid"
            if not problem and self.cfg.mode == "rl":
                problem = self._too_stale(batch)
                reason = STALE
            if problem:
                self.refused += bool(again)
                self.stale_batches += reason == STALE
                log.warning("%s", problem)
                for rec in records:
                    await self.source.dead_letters.send(rec, reason=reason, detail=problem)
                    self.source.advance(rec)
                self._report_progress()  # the buffers count what is queued for the trainer from what it consumed
                continue
            self._idle.clear()
            try:
                # the step span continues the batch's trace (the buffer's context travels in the record headers)
                with _tracer.start_as_current_span("trainer.step", context=records[0].context, attributes={
                        "batch_id": batch.batch_id, "step": self.step + 1, "policy_version": self.version,
                        "episodes": len(batch.episode_ids)}):
                    await self._train_one(batch, records)
            finally:
                self._idle.set()
        await asyncio.Event().wait()

    def _unusable(self, batch: Batch) -> str:
        """Why a decoded batch cannot be trained (it goes to the dead-letter topic), or ''."""
        from consumers.step import trim_width

        if not batch.episode_ids or not batch.loss_mask.any():
            return f"batch {batch.batch_id} has no response tokens"
        if (width := trim_width(batch)) > (cap := self.ctx.model.max_seq_len):
            return f"batch {batch.batch_id}: {width} tokens > model.max_seq_len {cap}"
        if int(batch.input_ids.max()) >= self.engine.policy.vocab_size or int(batch.input_ids.min()) < 0:
            return f"batch {batch.batch_id} has token ids outside the vocabulary"
        return ""

    def _too_stale(self, batch: Batch) -> str:
        """Why ``batch`` is too stale to train now (``max_staleness``, ``streamforge/staleness.py``), or ''."""
        if self.max_staleness is None:
            return ""
        worst = max_staleness(batch, self.version)
        if worst <= self.max_staleness:
            return ""
        return (f"batch {batch.batch_id}: a token {worst} versions behind the trainer's version {self.version} "
                f"(staleness.max_versions {self.max_staleness})")

    def _done_reason(self) -> str:
        if self.cfg.max_steps and self.step >= self.cfg.max_steps:
            return f"max_steps {self.cfg.max_steps} reached"
        if (self.cfg.reward_target != 0 and len(self._rewards) == self._rewards.maxlen
                and float(np.mean(self._rewards)) >= self.cfg.reward_target):
            return f"mean reward {np.mean(self._rewards):.3f} >= target {self.cfg.reward_target}"
        return ""

    async def _next_batch(self) -> tuple[Batch | None, list[Received]]:
        if self.cfg.mode == "rl":  # a publication owed is checked for every 50 ms (a buffer may wait for it)
            rec = await self.source.next(50 if self._owed() else self.cfg.poll_timeout_ms)
            return (rec.value, [rec]) if rec is not None else (None, [])
        records: list[Received] = []
        while len(records) < self.cfg.sft_batch_size and not self.stopping:
            rec = await self.source.next(self.cfg.poll_timeout_ms if not records else 50)
            if rec is None:
                break
            records.append(rec)
        if not records:
            return None, []
        batch = collate_sft(self.tokenizer, [r.value for r in records], max_seq_len=self.ctx.model.max_seq_len)
        return batch, records

    async def _train_one(self, batch: Batch, records: list[Received]) -> None:
        t0 = time.perf_counter()
        self.cmd.step(batch)
        metrics = await self._on_engine(self.engine.step, batch)
        self.step += 1
        if self.groups >= 0:
            self.groups += len(set(batch.group_ids))
        for rec in records:
            self.source.advance(rec)
        self.recent[batch.batch_id] = None
        while len(self.recent) > self.cfg.dedup_window:
            self.recent.popitem(last=False)
        self.ledger.record(step=self.step, policy_version=self.version, batch_ids=[batch.batch_id],
                           episode_ids=batch.episode_ids)
        self.trained_episodes.add(self.step, batch.episode_ids)
        self._since_publish.append(batch.batch_id)
        trained_reward = float(np.mean(batch.rewards)) if len(batch.rewards) else 0.0
        rollouts = batch.stats.get("rollout/episodes", 0.0)  # every scored rollout, zero-variance ones included
        reward = batch.stats["rollout/reward_mean"] if rollouts else trained_reward
        if self.cfg.mode == "rl":
            self._rewards.append(reward)
        elapsed = time.perf_counter() - t0
        row = {"step": self.step, "policy_version": self.version, "time_s": round(time.time() - self._t0, 4),
               "time": time.time(), "reward_mean": reward, "reward_trained_mean": trained_reward,
               "rollout_episodes": rollouts, "loss": metrics.get("loss", 0.0),
               "staleness_mean": staleness(batch, self.version),
               "staleness_max": max_staleness(batch, self.version), "episodes": len(batch.episode_ids),
               "tokens_per_s": metrics.get("tokens", 0.0) / max(elapsed, 1e-9), "batch_id": batch.batch_id,
               "duplicates": self.duplicates, "refused_batches": self.refused, "stale_batches": self.stale_batches,
               **{k: v for k, v in metrics.items() if k not in ("loss",)},
               **self._buffer_drops(batch), **self._env_metrics(batch)}
        self.metrics_out.append(row)
        _record(row, self.step)
        if self._publish_due():
            await self._publish()
        self._report_progress()
        if self.step % self.cfg.checkpoint_every == 0:
            await self._checkpoint()

    def _report_progress(self) -> None:
        """Write ``TrainerProgress`` (steps and groups trained, the version trained with) to the KV store, in the
        background: buffers count the batches queued for the trainer from it, generators their quota. Writes
        coalesce (the newest wins); a failed one is logged and the next step's replaces it."""
        if self.publisher is None:
            return
        consumed = sum(self.source.offsets.values()) if self.source is not None else -1
        self._progress_due = TrainerProgress(step=self.step, version=self.version,
                                             published_step=self._published_step, consumed=consumed,
                                             publish_every=self.cfg.publish_every, groups=self.groups,
                                             trainer_id=self.trainer_id)
        if self._progress_task is None or self._progress_task.done():
            self._progress_task = asyncio.ensure_future(self._write_progress())

    async def _write_progress(self) -> None:
        while self._progress_due is not None:
            progress, self._progress_due = self._progress_due, None
            try:
                await within(self.publisher.store.put_progress(progress), self.weightsync.timeout_s)
            except Exception as exc:  # noqa: BLE001 - progress is advisory: the next step writes it again
                log.warning("could not write the trainer's progress (step %d): %s", progress.step, exc)

    def _buffer_drops(self, batch: Batch) -> dict[str, float]:
        """``buffer/dropped/<reason>``: each buffer's drop counters (on its latest batch), summed over buffers."""
        drops = {k.removeprefix("dropped/"): v for k, v in batch.stats.items() if k.startswith("dropped/")}
        if drops or batch.buffer_id in self._drops:
            self._drops[batch.buffer_id] = drops
        total: dict[str, float] = {}
        for per_buffer in self._drops.values():
            for reason, n in per_buffer.items():
                total[f"buffer/dropped/{reason}"] = total.get(f"buffer/dropped/{reason}", 0.0) + n
        return total

    def _env_metrics(self, batch: Batch) -> dict[str, float]:
        """``env/turns_mean``, ``env/tool_calls_mean`` of the batch; ``env/restarts`` summed over buffers."""
        self._env_restarts[batch.buffer_id] = batch.stats.get("env/restarts", 0.0)
        return {"env/turns_mean": batch.stats.get("env/turns_mean", 1.0),
                "env/tool_calls_mean": batch.stats.get("env/tool_calls_mean", 0.0),
                "env/restarts": sum(self._env_restarts.values())}

    def _owed(self) -> bool:
        """``publish_busy: skip`` and ``publish_every`` steps trained since the last publication."""
        return self.cfg.publish_busy == "skip" and self.step - self._published_step >= self.cfg.publish_every

    def _publish_due(self) -> bool:
        """Every ``publish_every`` steps; with ``publish_busy: skip``, not while the previous round is in flight:
        the steps since the last version then join the next one, published after the next step or, when no batch
        comes (a buffer holding its batches until the trainer's version moves), as soon as the round ended."""
        if self.cfg.publish_busy == "wait":
            return self.step % self.cfg.publish_every == 0
        return self._owed() and (self._round is None or self._round.done())

    async def _publish(self) -> None:
        self._published_step = self.step
        if self.publisher is None:
            self.version += 1
            self._since_publish = []
            return
        if self._round is not None:
            await self._round  # at most one round in flight; a failed round (StaleWriter...) stops the role
        self.version += 1
        self.cmd.send(PUBLISH)
        with _tracer.start_as_current_span("trainer.publish", attributes={"version": self.version}):
            self._round = await self.publisher.submit(version=self.version, step=self.step,
                                                      named_tensors=self.engine.named_tensors,
                                                      batch_ids=list(self._since_publish))
        self._since_publish = []

    async def _checkpoint(self) -> None:
        meta = CheckpointMeta(step=self.step, policy_version=self.version, offsets=dict(self.source.offsets),
                              recent_batch_ids=list(self.recent), world_size=self.d.world_size, groups=self.groups)
        self.cmd.checkpoint(meta)
        with _tracer.start_as_current_span("trainer.checkpoint", attributes={"step": self.step}):
            path = await self._on_engine(self.engine.save, meta)
        self._checkpointed_step = self.step
        await self.source.commit()
        log.info("checkpoint %s", path)
