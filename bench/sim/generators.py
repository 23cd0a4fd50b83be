"""Many simulated generators on one event loop: ``python -m bench.sim.generators SPEC.json`` (a child of
``bench/sim/fleet.py``).

Each simulated generator is a generator role without its GPU (an engine of ``generation_tp`` GPUs in a
``--params`` run): the intake of ``producers/flow.Backpressure`` with
the run config's derived bounds (``generator.max_policy_lag``, ``groups_per_step``, ``quota_window_steps``, the
zero-variance refund and the liveness guard of ``producers/intake.py``), quota refunds of dropped groups read from
the ``drops`` topic (``producers/refunds.DropRefunds``, one reader for the process), real Episodes built by
``producers/pipeline.build_episodes`` and produced to ``episodes`` keyed by group id, a group at a time once all of
it is scored, through the process's ``topics.kafka.Producer``; policy versions and the trainer's progress from the
run's NATS KV bucket (``topics.nats.PolicyStore`` watches, one per process). Prompts come from the run's
``prompts`` topic, which the real feeder fills (``bench/sim/prompts.PromptFeed``: the process is one member of the
``generators`` group and commits a prompt once its group is on the broker); at most ``max_inflight`` of them are
generating in the process at once (AReaL's rollout cap, ``bench/sim/perf.py``; 0 = none). A prompt's lengths are a
function of its id, so every mode sees the same. Only the GPU is simulated (``speed``: ``bench/sim/model.FleetModel``
or ``bench/sim/perf.EngineSpeed``): decoding with continuous batching at a rate set by the running sequences and
their context, a new prompt's prefill and a weight swap as pauses. An Episode carries one token per
``token_scale`` simulated ones (its versions in proportion), so a long-context run fits the host's brokers.

Prints ``ready`` once its feed is in the ``generators`` group, starts generating on SIGUSR1 (the fleet sends it
once every process is ready: the group is stable), runs until SIGTERM, then writes its counters to the spec's
``stats`` path and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from bench.sim.model import FleetModel
from bench.sim.perf import EngineSpeed, SimParams
from bench.sim.prompts import PromptFeed
from producers.engine import Completion
from producers.flow import Backpressure, quota_phase
from producers.pipeline import build_episodes
from producers.refunds import DropRefunds
from streamforge.config import load_config
from topics.kafka import DeadLetters, Producer
from topics.nats import PolicyStore, connect
from topics.schemas import DropRecord


@dataclass(slots=True)
class Seq:
    """One response being decoded: its length, its prompt's tokens, tokens done (fractional), and tokens per policy
    version."""

    length: int
    prompt: int = 0
    done: float = 0.0
    counted: int = 0  # whole tokens already assigned a version
    versions: list[tuple[int, int]] = field(default_factory=list)  # (version, tokens) runs
    finished: asyncio.Future | None = None


class SimGenerator:
    """One generator GPU (module docstring)."""

    def __init__(self, gen_id: str, fleet: Fleet, seed: int) -> None:
        self.gen_id = gen_id
        self.fleet = fleet
        self.m = fleet.speed
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
        self.paused = 0  # pauses in progress
        self.last = time.monotonic()
        self.wake = asyncio.Event()  # the decoder: a new sequence, a swap ended
        self.changed = asyncio.Event()  # the intake: a group finished, a version, progress, a refund
        self.swap_due = asyncio.Event()
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
        rate = self.rate()
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

    def rate(self) -> float:
        return self.m.rate(len(self.running), sum(s.prompt + s.done for s in self.running))

    async def decoder(self) -> None:
        """Advances the running sequences; waits until the next one finishes or ``wake`` (a new sequence, the end of
        a swap). Runs until cancelled."""
        while True:
            self.advance()
            timeout = None
            if self.running and not self.paused:
                left = min(s.length - s.done for s in self.running) / self.rate()
                timeout = max(min(left, self.m.refresh_s) / self.m.time_scale, 0.0005)
            self.wake.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self.wake.wait()
            except TimeoutError:
                pass

    async def swapper(self) -> None:
        """Loads each announced version: the decoder pauses ``speed.swap_s`` simulated seconds. Waits on
        ``swap_due`` (a newer version announced). Runs until cancelled."""
        while True:
            await self.swap_due.wait()
            self.swap_due.clear()
            while self.target > self.version:
                target = self.target
                self.advance()
                t0 = time.monotonic()
                await self.pause(self.m.swap_s([s.prompt + s.done for s in self.running]))
                self.version = target
                self.stats["swaps"] += 1
                self.stats["swap_s"] += (time.monotonic() - t0) * self.m.time_scale
                self.changed.set()

    async def pause(self, sim_s: float) -> None:
        """Decode nothing for ``sim_s`` simulated seconds (a swap, a prefill); pauses may nest."""
        if sim_s <= 0:
            return
        self.advance()
        self.paused += 1
        try:
            await asyncio.sleep(sim_s / self.m.time_scale)
        finally:
            self.paused -= 1
            if not self.paused:
                self.last = time.monotonic()  # no decoding during the pause
                self.wake.set()

    # -- intake ----------------------------------------------------------------------------------
    def may_take(self) -> bool:
        return (self.groups < self.fleet.max_concurrent and self.fleet.room()
                and self.bp.open(self.version))

    async def intake(self) -> None:
        """Takes a prompt while a slot is free and ``Backpressure`` is open; the liveness guard grants more after
        ``stall_s()`` blocked with nothing in flight. Waits on ``changed`` (re-checking every 0.5 s). Runs until
        cancelled."""
        stalled_since: float | None = None
        while True:
            if self.may_take():
                stalled_since = None
                self.groups += 1  # before the awaits: the next check sees the slot taken
                self.fleet.inflight += 1
                try:
                    rec = await self.fleet.feed.take(self.fleet.want())
                except BaseException:
                    self.groups -= 1
                    self.fleet.inflight -= 1
                    raise
                self.bp.took()
                task = asyncio.ensure_future(self.group(rec))
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
                "quota_blocked_s" if self.groups < self.fleet.max_concurrent else "")
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

    async def group(self, rec) -> None:
        """One prompt (a ``prompts`` record): decode ``group_size`` responses, score them, produce the group's
        Episodes, then mark the prompt done in the feed (its offset may be committed)."""
        try:
            m, rng, prompt = self.m, self.rng, rec.value
            self.stats["prompts"] += 1
            prompt_len, lengths = m.lengths(zlib.crc32(prompt.prompt_id.encode()))
            k = m.token_scale
            prompt_tokens = rng.integers(3, self.fleet.vocab, max(1, math.ceil(prompt_len / k)), dtype=np.int32)
            t0 = time.time()
            await self.pause(m.prefill_s(prompt_len))
            loop = asyncio.get_running_loop()
            self.advance()  # the others' progress up to now, at the old rate
            seqs = [Seq(length=int(n), prompt=prompt_len, finished=loop.create_future()) for n in lengths]
            self.running.extend(seqs)
            self.wake.set()
            await asyncio.gather(*(s.finished for s in seqs))
            elapsed = time.time() - t0
            completions = []
            for i, s in enumerate(seqs):
                n = max(1, math.ceil(s.length / k))
                completions.append(Completion(
                    index=i, token_ids=rng.integers(3, self.fleet.vocab, n, dtype=np.int32),
                    logprobs=-rng.exponential(1.0, n).astype(np.float32), versions=scaled_versions(s.versions, n),
                    finish_reason="length" if s.length >= m.cap else "stop", generate_s=elapsed))
            episodes = build_episodes(prompt, prompt_tokens, completions, generator_id=self.gen_id,
                                      engine_version=self.version, queued_s=0.0)
            p = rng.beta(self.fleet.reward_alpha, self.fleet.reward_beta)
            rewards = [float(rng.random() < p) for _ in episodes]
            for ep, r in zip(episodes, rewards):
                ep.reward = r
                ep.validate()
            if max(rewards) == min(rewards):
                self.stats["zero_variance"] += 1
            self.bp.scored(rewards)
            # a group once scored is produced whole, also when the process is told to stop meanwhile
            producing = asyncio.ensure_future(self.produce(prompt.prompt_id, episodes, rec))
            self.fleet.producing.add(producing)
            producing.add_done_callback(self.fleet.producing.discard)
            await asyncio.shield(producing)
        finally:
            self.groups -= 1
            self.fleet.inflight -= 1
            self.fleet.changed()

    async def produce(self, group_id: str, episodes: list, rec) -> None:
        """Produce one group's Episodes keyed by group id; returns once the broker acknowledged all of them (and
        the prompt is marked done in the feed)."""
        producer, topic = self.fleet.producer, self.fleet.cfg.names.episodes
        acks = [await producer.enqueue(topic, ep, key=ep.group_id) for ep in episodes]
        await asyncio.gather(*acks)
        self.fleet.feed.done(rec)
        if self.fleet.refunds is not None:
            self.fleet.by_group[group_id] = self
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
        gen = self.fleet.by_group.pop(drop.group_id, None)
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
        self.speed = speed_of(spec)
        self.max_concurrent = self.cfg.generator.max_concurrent_prompts
        self.max_inflight = spec.get("max_inflight", 0)  # prompts generating in this process at once (0: no cap)
        self.inflight = 0
        self.vocab = spec.get("vocab", 32000)
        self.reward_alpha, self.reward_beta = spec.get("reward_beta", (2.0, 2.0))
        self.gens = [SimGenerator(gid, self, spec["seed"] * 100_003 + i) for i, gid in enumerate(spec["ids"])]
        self.by_group: dict[str, SimGenerator] = {}  # group produced -> its generator (drop refunds)
        self.producer: Producer | None = None
        self.feed: PromptFeed | None = None
        self.refunds: FleetRefunds | None = None
        self.stop = asyncio.Event()
        self.producing: set[asyncio.Future] = set()  # groups being produced: finished before the process stops
        self.failure: BaseException | None = None
        self.versions_seen = 0

    def room(self) -> bool:
        """Under the process's in-flight cap."""
        return not self.max_inflight or self.inflight < self.max_inflight

    def want(self) -> int:
        """Prompts worth fetching at once: the free slots of the process."""
        free = sum(max(0, self.max_concurrent - g.groups) for g in self.gens)
        if self.max_inflight:
            free = min(free, self.max_inflight - self.inflight)
        return max(1, free)

    def changed(self) -> None:
        """A slot freed: every generator re-checks (the in-flight cap is shared)."""
        for g in self.gens:
            g.changed.set()

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
        self.feed = PromptFeed(cfg.kafka, cfg.names, DeadLetters(self.producer, cfg.names, "generator"),
                               client_id=f"simgen-{self.spec['process']}")
        await self.feed.start()
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
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        go = asyncio.Event()  # SIGUSR1: every process of the fleet is in the group, which is stable
        loop.add_signal_handler(signal.SIGUSR1, go.set)
        async with asyncio.timeout(120):  # the group's first assignment (a Tansu join takes 3-5 s)
            await self.feed.assigned.wait()
        print("ready", flush=True)
        async with asyncio.timeout(300):
            await go.wait()  # taking prompts before the last member joined would see them handed out again
        for g in self.gens:
            loops += [g.decoder(), g.swapper(), g.intake()]
        tasks = [asyncio.ensure_future(c) for c in loops]
        for t in tasks:
            t.add_done_callback(lambda t: t.cancelled() or self.stop.set())
        t0, cpu0 = time.monotonic(), time.process_time()
        await self.stop.wait()
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        for t in tasks + [t for g in self.gens for t in g.tasks]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*list(self.producing), return_exceptions=True)
        failures = [repr(t.exception()) for t in tasks if not t.cancelled() and t.exception() is not None]
        if self.feed.failure is not None:
            failures.append(repr(self.feed.failure))
        await self.feed.stop()
        if self.refunds is not None:
            await self.refunds.stop()
        await self.producer.stop()
        await nc.close()
        out: dict = {"process": self.spec["process"], "wall_s": wall, "cpu_s": cpu, "versions_seen": self.versions_seen,
                     "failures": failures + ([repr(self.failure)] if self.failure else []),
                     "refunded": self.refunds.refunded if self.refunds else 0,
                     **{f"prompts_{k}": v for k, v in self.feed.stats.items()}}
        for key in self.gens[0].stats:
            out[key] = sum(g.stats[key] for g in self.gens)
        return out


def speed_of(spec: dict) -> FleetModel | EngineSpeed:
    """The simulated GPU of a spec: ``params`` (a preset's dict, with ``time_scale``, ``token_scale`` and
    ``train_gpus``), else ``model`` (a ``FleetModel``'s fields)."""
    if spec.get("params"):
        from omegaconf import OmegaConf

        params = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SimParams), spec["params"]))
        return EngineSpeed(params, time_scale=spec["time_scale"], token_scale=spec["token_scale"],
                           train_gpus=spec["train_gpus"])
    return FleetModel(**spec["model"])


def scaled_versions(runs: list[tuple[int, int]], n: int) -> np.ndarray:
    """``n`` tokens' versions for a response whose simulated tokens ran ``runs`` (version, tokens): each carried
    token takes the version of the simulated token at its share of the response."""
    versions = np.array([v for v, _ in runs], dtype=np.int32)
    ends = np.cumsum([t for _, t in runs])
    at = (np.arange(n) + 0.5) * ends[-1] / n
    return versions[np.minimum(np.searchsorted(ends, at, side="right"), len(versions) - 1)]


def main() -> None:
    spec = orjson.loads(Path(sys.argv[1]).read_bytes())
    stats = asyncio.run(Fleet(spec).run())
    Path(spec["stats"]).write_bytes(orjson.dumps(stats))


if __name__ == "__main__":
    main()
