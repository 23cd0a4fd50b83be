"""The evaluator role: a late-joining consumer of policy versions that scores each on held-out prompts.

``EvaluatorRole(cfg, ctx, generator=, feeder_source=)`` (``streamforge run evaluator``; ``up.evaluators: 1``) runs
a vLLM engine of its own (``producers.engine.Engine``) and follows the run's policy KV bucket on NATS
(``PolicyStore.watch`` for versions, ``watch_progress`` for steps). Whenever a new version is published or a step
trained, it looks for the newest export of the trainer's weights (``producers/evaluation.py``: every checkpoint's
``hf/``, and with ``weightsync.transport: file`` every version's directory); once one is at least
``eval.every_versions`` versions past the last it evaluated, it loads it (``reload_weights``) and evaluates it on
the held-out prompts (``eval_prompts``: the task's ``eval`` split, disjoint from every training prompt): one greedy
completion per prompt (``eval/reward_mean`` with the training rewards, local ones only, ``eval/accuracy`` = share whose
``eval.correct_reward`` is >= 1) and ``eval.samples`` sampled ones at ``eval.temperature`` (``eval/pass_at_k``,
``eval/pass_at_1``). Each evaluation appends one row to ``<run_dir>/eval.jsonl``: ``policy_version``, ``step``,
``time_s`` (since this evaluator started), ``eval/reward_mean``, ``eval/accuracy``, ``eval/pass_at_k``,
``episodes`` (prompts evaluated), ``k``, ``samples``, ``skipped``, ``eval_s``, ``time``, ``eval/pass_at_1``,
``eval/sample_reward_mean``, ``reward_failures``; the same values go to its metrics (``metrics-evaluator.jsonl``).

Why exports and not weight sync: a weight-sync member is pushed every version and the trainer's publication round
waits for its ack (until ``weightsync.ack_deadline_s``, then fences it). An evaluator must hold one version for a
whole evaluation, so it would either ack late (slowing every round, and with ``trainer.publish_busy: wait`` every
step) or swap in the middle of an evaluation; each push would also cost the trainer a copy over its pair group.
The exports cost the trainer nothing more (it writes checkpoints anyway), a late joiner finds the newest one on
disk without a handshake, and a slow evaluator simply jumps to the newest export: the versions it passes over are
counted (``skipped``). The price: with the collective transports it sees the versions the trainer checkpoints
(``trainer.checkpoint_every``), and a checkpoint's ``policy_version`` is the newest version published by its
step (the same weights when the trainer published at that step).

Each export's safetensors are hard-linked into ``<run_dir>/evaluator/weights`` before loading, so the trainer
pruning that checkpoint meanwhile cannot pull the file from under the load.

Loops: ``policy`` and ``progress`` (the watches: each wakes ``evaluate``), ``evaluate`` (waits for a wake, then
evaluates what is due; never returns). Before any version is published the initial weights are evaluated as
version 0. Drain: the evaluation in flight finishes, then the newest export not yet evaluated (the trainer's final
checkpoint) is evaluated, within ``up.drain_timeout_s``. A restarted evaluator continues after the last version in
its ``eval.jsonl``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import orjson

from models.tiny_model import ensure_model
from producers import vllm_fork
from producers.config import GeneratorConfig
from producers.engine import Engine, Sampling, check_block_size
from producers.evaluation import (
    EvalConfig,
    Export,
    PromptResult,
    available_exports,
    due_export,
    resolve_source,
    summarise,
)
from producers.prompts import PromptChecker
from producers.rewards import RewardFailed, RewardSet
from producers.sources import eval_prompts
from runtime.context import RoleContext
from runtime.cpus import pin
from runtime.lifecycle import Service
from runtime.metrics import flush_metrics, record_metric
from topics.deadlines import within
from topics.errors import ConfigError, StreamforgeError
from topics.nats import PolicyStore, connect
from topics.schemas import PolicyVersion, Prompt

log = logging.getLogger("streamforge.evaluator")

EVAL_FILE = "eval.jsonl"


def read_eval_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of an eval.jsonl (none if it does not exist; a torn last line is skipped)."""
    from runtime.telemetry import read_jsonl

    return read_jsonl(path) if os.path.exists(path) else []


class EvaluatorRole(Service):
    """See the module docstring. ``generator``: the run's generator section (rewards, chat template, max_tokens,
    engine options); ``feeder_source``: where the held-out split comes from when ``eval.source`` is empty;
    ``engine`` may be injected (tests)."""

    name = "evaluator"

    def own_process(self) -> None:
        """This process is the evaluator's: its engine's processes may be forked (``producers/vllm_fork.py``)."""
        vllm_fork.own_process()

    def __init__(self, cfg: EvalConfig, ctx: RoleContext, *, generator: GeneratorConfig, feeder_source: str,
                 engine: Engine | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ctx = ctx
        self.gen = generator
        self.source = resolve_source(cfg, feeder_source)  # a ConfigError at build time names eval.source
        self.drain_timeout_s = ctx.drain_timeout_s
        self.engine = engine
        self._own_engine = engine is None
        self.max_tokens = cfg.max_tokens or generator.max_tokens
        self.rewards: RewardSet | None = None
        self.correct = ""  # the name of the reward that decides correctness
        self.prompts: list[tuple[Prompt, list[int]]] = []
        self.nc: Any = None
        self.store: PolicyStore | None = None
        self.latest: PolicyVersion | None = None
        self.last_version: int | None = None  # the last version evaluated (None: none yet)
        self.skipped = 0
        self.evaluations = 0
        self.path = ctx.run_dir / EVAL_FILE
        self.staging = ctx.run_dir / "evaluator" / "weights"
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one evaluation at a time (the loop's, or the drain's final one)
        self._draining = False
        self._t0 = time.time()

    # -- lifecycle ------------------------------------------------------------------------------
    async def _start(self) -> None:
        try:
            await self._open()
        except BaseException:
            await self._stop()
            raise

    async def _open(self) -> None:
        ctx, cfg, gen = self.ctx, self.cfg, self.gen
        held_out = eval_prompts(self.source, size=cfg.size, seed=cfg.seed)
        if not held_out:
            raise ConfigError("eval.source", f"{self.source!r} gives no held-out prompt")
        self.rewards = RewardSet(gen.rewards, gen.reward_weights, timeout_s=gen.reward_timeout_s,
                                 max_workers=min(32, 2 * (cfg.samples + 1)))
        if self.rewards.remote:
            raise ConfigError("generator.rewards", "the evaluator scores with local rewards only (no remote:)")
        self.correct = cfg.correct_reward or self.rewards.names[0]
        if self.correct not in self.rewards.names:
            raise ConfigError("eval.correct_reward", f"{self.correct!r} is not one of generator.rewards "
                                                     f"{self.rewards.names}")
        if self.engine is None:
            if cores := pin(cfg.cpus, key="eval.cpus"):  # before the engine: its processes inherit it
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpus
                log.info("evaluator runs on cores %s", cores)
            check_block_size(gen.kv_block_size, "generator.kv_block_size")
            model = ensure_model(ctx.model.path, ctx.run_dir, seed=ctx.run.seed, source=ctx.model.source,
                                 cache_dir=ctx.model.cache_dir)
            self.engine = Engine(str(model), max_model_len=ctx.model.max_seq_len, seed=cfg.seed,
                                 kv_cache_gib=cfg.kv_cache_gib, gpu_memory_utilization=cfg.gpu_memory_utilization,
                                 enforce_eager=gen.enforce_eager, max_num_seqs=gen.max_num_seqs,
                                 max_num_batched_tokens=gen.max_num_batched_tokens,
                                 start_method=gen.vllm_start_method, block_size=gen.kv_block_size)
        await self.engine.start()  # first: it blocks the loop for ~15 s on CPU
        engine = self.engine
        checker = PromptChecker(engine.tokenizer, max_model_len=getattr(engine, "max_model_len", ctx.model.max_seq_len),
                                max_tokens=self.max_tokens, vocab_size=lambda: engine.llm.model_config.get_vocab_size(),
                                chat_template=gen.chat_template, system_prompt=gen.system_prompt)
        for p in held_out:
            tokens, why = checker.check(p)
            if why:
                raise ConfigError("eval.source", f"a held-out prompt the engine cannot take: {why}")
            self.prompts.append((p, tokens))
        self.nc = await connect(ctx.nats, name="evaluator")
        self.store = PolicyStore(self.nc, ctx.names, history=ctx.nats.kv_history, timeout_s=ctx.nats.request_timeout_s)
        await self.store.start()
        self.latest, _ = await self.store.latest_good()
        done = read_eval_rows(self.path)
        if done:  # a restart continues after what it evaluated
            self.last_version = max(int(r["policy_version"]) for r in done)
            self.skipped = int(done[-1].get("skipped", 0))
        self._wake.set()
        log.info("evaluator started: %d held-out prompts from %s, latest version %s, last evaluated %s",
                 len(self.prompts), self.source, None if self.latest is None else self.latest.version,
                 self.last_version)

    async def _stop(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            try:
                await within(self.nc.drain(), self.ctx.nats.request_timeout_s)
            except Exception as exc:  # noqa: BLE001 - close the rest whatever failed
                log.warning("evaluator stop: NATS: %s", exc)
        if self.rewards is not None:
            self.rewards.close()
        if self._own_engine and self.engine is not None:
            await self.engine.stop()

    def loops(self) -> dict[str, Any]:
        return {"policy": self._policy(), "progress": self._progress(), "evaluate": self._evaluate_loop()}

    async def drain(self) -> None:
        """Finish the evaluation in flight, then evaluate the newest export not evaluated yet (the final one)."""
        self._draining = True
        async with self._lock:
            await self._evaluate_due(final=True)

    # -- loops ----------------------------------------------------------------------------------
    async def _policy(self) -> None:
        """Consumes ``PolicyStore.watch()`` (the current version first): records it and wakes ``evaluate``."""
        assert self.store is not None
        async for pv in self.store.watch():
            self.latest = pv
            self._wake.set()
        raise StreamforgeError("the policy store watch ended", retriable=True)

    async def _progress(self) -> None:
        """Consumes ``PolicyStore.watch_progress()``: a trained step may have written a checkpoint; wakes
        ``evaluate``."""
        assert self.store is not None
        async for _ in self.store.watch_progress():
            self._wake.set()
        raise StreamforgeError("the trainer-progress watch ended", retriable=True)

    async def _evaluate_loop(self) -> None:
        """Waits for a wake (a version or a step), then evaluates what is due (one at a time). Never returns."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            async with self._lock:
                if not self._draining:
                    await self._evaluate_due()

    # -- evaluation -----------------------------------------------------------------------------
    async def _evaluate_due(self, *, final: bool = False) -> None:
        """Evaluate the export due now (``final``: the newest not evaluated, whatever ``every_versions``); before
        any version exists, the initial weights as version 0."""
        if self.latest is None and self.last_version is None:
            await self._evaluate(Export(0, 0, Path()), loaded=True)
            return
        exports = await asyncio.to_thread(available_exports, self.ctx.run_dir, self.latest)
        every = 1 if final else self.cfg.every_versions
        export, skipped = due_export(exports, self.last_version, every)
        if export is None:
            return
        if final and self.last_version is not None:  # the final evaluation is no skip of the cadence's
            skipped = max(0, (export.version - self.last_version) // self.cfg.every_versions - 1)
        staged = await asyncio.to_thread(self._stage, export)
        if staged is None:
            return  # pruned before it could be linked: the next wake finds a newer one
        self.skipped += skipped
        await self._evaluate(export, path=staged)

    def _stage(self, export: Export) -> Path | None:
        """Hard-link (or copy, across file systems) the export's safetensors into the staging directory."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        try:
            for f in export.path.iterdir():
                if f.name.endswith(".safetensors"):
                    try:
                        os.link(f, self.staging / f.name)
                    except OSError as exc:
                        if isinstance(exc, FileNotFoundError):
                            raise
                        shutil.copy2(f, self.staging / f.name)
        except FileNotFoundError:
            log.info("the export of version %d (step %d) was pruned before it was loaded", export.version, export.step)
            return None
        return self.staging

    def _append(self, row: dict[str, Any]) -> None:
        with open(self.path, "ab") as fh:  # one write per row
            fh.write(orjson.dumps(row) + b"\n")

    async def _evaluate(self, export: Export, *, path: Path | None = None, loaded: bool = False) -> None:
        """Load ``export`` (unless ``loaded``), evaluate every held-out prompt, append the row."""
        assert self.engine is not None and self.rewards is not None
        engine = self.engine
        if not loaded:
            async def load(llm: Any) -> None:
                await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})

            await engine.swap(export.version, load, mode="wait")
        t0 = time.monotonic()
        greedy = Sampling(max_tokens=self.max_tokens, temperature=0.0)
        sampled = Sampling(max_tokens=self.max_tokens, temperature=self.cfg.temperature)
        failures = 0

        async def one(prompt: Prompt, tokens: list[int]) -> PromptResult:
            nonlocal failures
            rid = f"eval-{export.version}-{prompt.prompt_id}"
            g, s = await asyncio.gather(engine.generate(tokens, 1, greedy, request_id=f"{rid}-g"),
                                        engine.generate(tokens, self.cfg.samples, sampled, request_id=f"{rid}-s"))
            scored = await self.rewards.score_group(prompt, [g[0].text] + [c.text for c in s])
            rewards, correct = [], []
            for res in scored:
                if isinstance(res, RewardFailed):
                    failures += 1
                    rewards.append(0.0)
                    correct.append(False)
                else:
                    rewards.append(res.reward)
                    correct.append(res.components.get(self.correct, 0.0) >= 1.0)
            return PromptResult(greedy_reward=rewards[0], greedy_correct=correct[0], samples_correct=correct[1:],
                                samples_reward=rewards[1:])

        results = await asyncio.gather(*(one(p, tokens) for p, tokens in self.prompts))
        metrics = summarise(results, self.cfg.k)
        now = time.time()
        row = {"policy_version": export.version, "step": export.step, "time_s": round(now - self._t0, 4),
               **{k: round(v, 6) for k, v in metrics.items()}, "episodes": len(results), "k": self.cfg.k,
               "samples": self.cfg.samples, "skipped": self.skipped, "eval_s": round(time.monotonic() - t0, 4),
               "time": now, "reward_failures": failures}
        self._append(row)
        for key, value in metrics.items():
            record_metric(key, value)
        record_metric("eval/skipped", self.skipped, "max")
        record_metric("eval/policy_version", export.version, "max")
        flush_metrics(export.version)
        self.last_version = export.version
        self.evaluations += 1
        log.info("version %d (step %d): accuracy %.3f, pass@%d %.3f, reward %.3f on %d prompts in %.1f s "
                 "(%d skipped so far)", export.version, export.step, metrics["eval/accuracy"], self.cfg.k,
                 metrics["eval/pass_at_k"], metrics["eval/reward_mean"], len(results), row["eval_s"], self.skipped)
