"""Many simulated generators on one event loop: ``python -m bench.sim.generators SPEC.json`` (a child of
``bench/sim/fleet.py``).

Each simulated generator is a generator role without its GPU: the intake of ``producers/flow.Backpressure`` with
the run config's derived bounds (``generator.max_policy_lag``, ``groups_per_step``, ``quota_window_steps``, the
zero-variance refund and the liveness guard of ``producers/intake.py``), quota refunds of dropped groups read from
the ``drops`` topic (``producers/refunds.DropRefunds``, one reader for the process), real Episodes built by
``producers/pipeline.build_episodes`` and produced to ``episodes`` keyed by group id, a group at a time once all of
it is scored, through the process's ``topics.kafka.Producer``; policy versions and the trainer's progress from the
run's NATS KV bucket (``topics.nats.PolicyStore`` watches, one per process). Only the GPU is simulated
(``bench/sim/model.py``): decoding with continuous batching, and a weight swap as a pause.

Runs until SIGTERM, then writes its counters to the spec's ``stats`` path and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from bench.sim.model import FleetModel
from producers.engine import Completion
from producers.flow import Backpressure, quota_phase
from producers.pipeline import build_episodes
from producers.refunds import DropRefunds
from streamforge.config import load_config
from topics.kafka import Producer
from topics.nats import PolicyStore, connect
from topics.schemas import DropRecord, Prompt


@dataclass(slots=True)
class Seq:
    """One response being decoded: its length, tokens done (fractional), and tokens per policy version."""

    length: int
    done: float = 0.0
    counted: int = 0  # whole tokens already assigned a version
    versions: list[tuple[int, int]] = field(default_factory=list)  # (version, tokens) runs
    finished: asyncio.Future | None = None


class SimGenerator:
    """One generator GPU (module docstring)."""

    def __init__(self, gen_id: str, fleet: Fleet, seed: int) -> None:
        self.gen_id = gen_id
        self.fleet = fleet
        self.m = fleet.model
        g = fleet.cfg.generator
        self.bp = Backpressure(max_policy_lag=g.max_policy_lag, groups_per_step=g.groups_per_step,
                               window_steps=g.quota_window_steps, stall_s_config=g.backpressure_stall_s,
                               count_zero_variance=g.quota_counts_zero_variance, phase=quota_phase(gen_id),
                               groups_per_batch=g.quota_groups_per_batch)
        self.rng = np.random.default_rng(seed)
        self.version = 0  # the weights' policy version
        self.target = 0  # the newest version announced
        self.running: list[Seq] = []
        self.groups = 0  # groups in flight
        self.paused = False
        self.last = time.monotonic()
        self.wake = asyncio.Event()  # the decoder: a new sequence, a swap ended
        self.changed = asyncio.Event()  # the intake: a group finished, a version, progress, a refund
        self.swap_due = asyncio.Event()
        self.next_prompt = 0
        self.tasks: set[asyncio.Task] = set()
        self.stats = {"prompts": 0, "groups": 0, "episodes": 0, "tokens": 0.0, "swaps": 0, "grants": 0,
                      "zero_variance": 0, "quota_blocked_s": 0.0, "lag_blocked_s": 0.0, "swap_s": 0.0}

    # -- decoding (the simulated GPU) --------------------------------------------------------------
    def advance(self) -> None:
        """Decode up to now: every running sequence advances at the shared rate (nothing while swapping)."""
        now = time.monotonic()
        dt = (now - self.last) * self.m.time_scale
        self.last = now
        if self.paused or not self.running or dt <= 0:
            return
        rate = self.m.rate(len(self.running))
        still = []
        for s in self.running:
            step = min(rate * dt, s.length - s.done)
            s.done += step
            self.stats["tokens"] += step
            whole = s.length if s.done >= s.length - 1e-6 else int(s.done)
            if whole > s.counted:
                if s.versions and s.versions[-1][0] == self.version:
                    s.versions[-1] = (self.version, s.versions[-1][1] + whole - s.counted)
                else:
                    s.versions.append((self.version, whole - s.counted))
                s.counted = whole
            if s.counted >= s.length:
                assert s.finished is not None
                if not s.finished.done():
                    s.finished.set_result(None)
            else:
                still.append(s)
        self.running = still

    async def decoder(self) -> None:
        """Advances the running sequences; waits until the next one finishes or ``wake`` (a new sequence, the end of
        a swap). Runs until cancelled."""
        while True:
            self.advance()
            timeout = None
            if self.running and not self.paused:
                rate = self.m.rate(len(self.running))
                left = min(s.length - s.done for s in self.running)
                timeout = max(left / rate / self.m.time_scale, 0.0005)
            self.wake.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self.wake.wait()
            except TimeoutError:
                pass

    async def swapper(self) -> None:
        """Loads each announced version: the decoder pauses ``model.swap_s`` simulated seconds. Waits on
        ``swap_due`` (a newer version announced). Runs until cancelled."""
        while True:
            await self.swap_due.wait()
            self.swap_due.clear()
            while self.target > self.version:
                target = self.target
                self.advance()
                self.paused = True
                t0 = time.monotonic()
                await asyncio.sleep(self.m.swap_s / self.m.time_scale)
                self.last = time.monotonic()  # no decoding during the pause
                self.paused = False
                self.version = target
                self.stats["swaps"] += 1
                self.stats["swap_s"] += (self.last - t0) * self.m.time_scale
                self.wake.set()
                self.changed.set()

    # -- intake ----------------------------------------------------------------------------------
    def may_take(self) -> bool:
        return self.groups < self.m.max_concurrent_prompts and self.bp.open(self.version)

    async def intake(self) -> None:
        """Takes a prompt while a slot is free and ``Backpressure`` is open; the liveness guard grants more after
        ``stall_s()`` blocked with nothing in flight. Waits on ``changed`` (re-checking every 0.5 s). Runs until
        cancelled."""
        stalled_since: float | None = None
        while True:
            if self.may_take():
                stalled_since = None
                self.bp.took()
                self.groups += 1  # before the task starts: the next check sees the slot taken
                task = asyncio.ensure_future(self.group())
                self.tasks.add(task)
                task.add_done_callback(self._done)
                continue
            self.changed.clear()
            now = time.monotonic()
            if self.bp.ahead() and not self.groups and not self.bp.behind(self.version):
                stalled_since = stalled_since or now
                if now - stalled_since >= self.bp.stall_s():
                    self.bp.grant()
                    self.stats["grants"] += 1
                    stalled_since = None
                    continue
            else:
                stalled_since = None
            blocked = "lag_blocked_s" if self.bp.behind(self.version) else (
                "quota_blocked_s" if self.groups < self.m.max_concurrent_prompts else "")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await self.changed.wait()
            if blocked:
                self.stats[blocked] += (time.monotonic() - now) * self.m.time_scale

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fleet.failure = task.exception()
            self.fleet.stop.set()

    async def group(self) -> None:
        """One prompt: decode ``group_size`` responses, score them, produce the group's Episodes."""
        try:
            m, rng = self.m, self.rng
            prompt_id = f"{self.gen_id}-{self.next_prompt}"
            self.next_prompt += 1
            self.stats["prompts"] += 1
            prompt_tokens = rng.integers(3, m.vocab, int(rng.integers(m.prompt_min, m.prompt_max + 1)),
                                         dtype=np.int32)
            t0 = time.time()
            loop = asyncio.get_running_loop()
            self.advance()  # the others' progress up to now, at the old rate
            seqs = [Seq(length=m.response_length(rng), finished=loop.create_future()) for _ in range(m.group_size)]
            self.running.extend(seqs)
            self.wake.set()
            await asyncio.gather(*(s.finished for s in seqs))
            elapsed = time.time() - t0
            completions = []
            for i, s in enumerate(seqs):
                versions = np.concatenate([np.full(n, v, dtype=np.int32) for v, n in s.versions])
                completions.append(Completion(
                    index=i, token_ids=rng.integers(3, m.vocab, s.length, dtype=np.int32),
                    logprobs=-rng.exponential(1.0, s.length).astype(np.float32), versions=versions,
                    finish_reason="length" if s.length >= m.length_cap else "stop", generate_s=elapsed))
            prompt = Prompt(prompt_id=prompt_id, task="sim", created_at=t0)
            episodes = build_episodes(prompt, prompt_tokens, completions, generator_id=self.gen_id,
                                      engine_version=self.version, queued_s=0.0)
            p = rng.beta(m.reward_alpha, m.reward_beta)
            rewards = [float(rng.random() < p) for _ in episodes]
            for ep, r in zip(episodes, rewards):
                ep.reward = r
                ep.validate()
            if max(rewards) == min(rewards):
                self.stats["zero_variance"] += 1
            self.bp.scored(rewards)
            # a group once scored is produced whole, also when the process is told to stop meanwhile
            producing = asyncio.ensure_future(self.produce(prompt_id, episodes))
            self.fleet.producing.add(producing)
            producing.add_done_callback(self.fleet.producing.discard)
            await asyncio.shield(producing)
        finally:
            self.groups -= 1
            self.changed.set()

    async def produce(self, group_id: str, episodes: list) -> None:
        """Produce one group's Episodes keyed by group id; returns once the broker acknowledged all of them."""
        producer, topic = self.fleet.producer, self.fleet.cfg.names.episodes
        acks = [await producer.enqueue(topic, ep, key=ep.group_id) for ep in episodes]
        await asyncio.gather(*acks)
        if self.fleet.refunds is not None:
            self.fleet.refunds.produced(group_id)
        self.stats["groups"] += 1
        self.stats["episodes"] += len(episodes)

    def announce(self, version: int, step: int) -> None:
        self.bp.published(version, step, time.monotonic())
        if version > self.target:
            self.target = version
            self.swap_due.set()
        self.changed.set()


class FleetRefunds(DropRefunds):
    """``DropRefunds`` for the whole process: a dropped group's quota goes back to the generator that made it."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet.cfg.kafka, fleet.cfg.names.drops, refund=lambda: None, client_id="simgen-drops")
        self.fleet = fleet

    def on_drop(self, drop: DropRecord) -> bool:
        gen = self.fleet.by_id.get(drop.group_id.rsplit("-", 1)[0])
        if gen is None:
            return False
        self.refund = gen.bp.refund
        refunded = super().on_drop(drop)
        if refunded:
            gen.changed.set()
        return refunded


class Fleet:
    """This process's generators and their shared clients."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.cfg = load_config(spec["config"], environ={})
        self.model = FleetModel(**spec["model"])
        self.gens = [SimGenerator(gid, self, spec["seed"] * 100_003 + i) for i, gid in enumerate(spec["ids"])]
        self.by_id = {g.gen_id: g for g in self.gens}
        self.producer: Producer | None = None
        self.refunds: FleetRefunds | None = None
        self.stop = asyncio.Event()
        self.producing: set[asyncio.Future] = set()  # groups being produced: finished before the process stops
        self.failure: BaseException | None = None
        self.versions_seen = 0

    async def watch_versions(self, store: PolicyStore) -> None:
        """Every generator hears each new PolicyVersion (KV watch). Runs until cancelled."""
        async for pv in store.watch():
            self.versions_seen = max(self.versions_seen, pv.version)
            for g in self.gens:
                g.announce(pv.version, pv.step)

    async def watch_progress(self, store: PolicyStore) -> None:
        """Every generator hears the trainer's progress (KV watch). Runs until cancelled."""
        async for p in store.watch_progress():
            for g in self.gens:
                g.bp.progressed(p.step, p.version, p.groups)
                g.changed.set()

    async def run(self) -> dict:
        cfg = self.cfg
        self.producer = Producer(cfg.kafka, client_id=f"simgen-{self.spec['process']}")
        await self.producer.start()
        nc = await connect(cfg.nats, name=f"simgen-{self.spec['process']}")
        store = PolicyStore(nc, cfg.names, history=cfg.nats.kv_history, timeout_s=cfg.nats.request_timeout_s)
        await store.start()
        current, _ = await store.latest_good()
        progress = await store.progress()
        steps = [x.step for x in (current, progress) if x is not None]
        for g in self.gens:
            if steps:
                g.bp.started_at(max(steps), progress.groups if progress is not None else None)
            if current is not None:
                g.version = g.target = current.version
        loops = [self.watch_versions(store), self.watch_progress(store)]
        if cfg.generator.groups_per_step > 0:
            self.refunds = FleetRefunds(self)
            await self.refunds.start()
            loops.append(self.refunds.loop())
        for g in self.gens:
            loops += [g.decoder(), g.swapper(), g.intake()]
        tasks = [asyncio.ensure_future(c) for c in loops]
        for t in tasks:
            t.add_done_callback(lambda t: t.cancelled() or self.stop.set())
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        print("ready", flush=True)
        t0, cpu0 = time.monotonic(), time.process_time()
        await self.stop.wait()
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        for t in tasks + [t for g in self.gens for t in g.tasks]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*list(self.producing), return_exceptions=True)
        failures = [repr(t.exception()) for t in tasks if not t.cancelled() and t.exception() is not None]
        if self.refunds is not None:
            await self.refunds.stop()
        await self.producer.stop()
        await nc.close()
        out: dict = {"process": self.spec["process"], "wall_s": wall, "cpu_s": cpu, "versions_seen": self.versions_seen,
                     "failures": failures + ([repr(self.failure)] if self.failure else []),
                     "refunded": self.refunds.refunded if self.refunds else 0}
        for key in self.gens[0].stats:
            out[key] = sum(g.stats[key] for g in self.gens)
        return out


def main() -> None:
    spec = orjson.loads(Path(sys.argv[1]).read_bytes())
    stats = asyncio.run(Fleet(spec).run())
    Path(spec["stats"]).write_bytes(orjson.dumps(stats))


if __name__ == "__main__":
    main()
