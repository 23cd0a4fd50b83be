"""One simulated-fleet run on the real infrastructure, and its accounting.

``run_fleet(FleetRun(...), workdir)`` starts, like ``streamforge up``:

* the embedded brokers (``streamforge/brokers.EmbeddedBrokers``: Tansu and nats-server) and the run's topics;
* the real feeder (``python -m streamforge run feeder``), which streams ``feeder.source`` into ``prompts``;
* ``buffers`` real buffer processes (``python -m streamforge run buffer``, one consumer group, one ``episodes``
  partition each), and waits until they own the partitions;
* the simulated trainer (``bench/sim/trainer.py``) and ``processes`` generator processes sharing the
  ``generators`` simulated generators (``bench/sim/generators.py``);

lets them run ``warmup_s`` real seconds, measures ``measure_s`` real seconds (CPU seconds of every process from
``/proc``, the ``episodes`` high-water marks and the buffers' committed offsets at both ends, the trainer's steps
inside the window), stops generators, trainer, feeder and buffers (SIGTERM: the buffers drain), runs the real audit
(``streamforge/audit.run_audit``) over the topics and the trainer's ledger, reads the buffers' offset-gap counters
(every ``offset_gap*`` key of the last row of ``metrics-buffer.jsonl``), and stops the brokers. A run of a preset
(``params``) runs until the trainer trained ``steps`` steps instead of a fixed window (``summarize_steps``).

Modes: ``sync`` is ``staleness.max_versions: 0`` with ``trainer.publish_busy: wait`` (every batch from the latest
weights), ``async`` the bounded default ``staleness.max_versions: 4`` with ``publish_busy: skip``, ``unbounded``
is ``-1`` (no quota, no staleness filter: the generators produce as fast as they simulate, for a capacity run).
Every other key derives from those as in a real run (``streamforge/staleness.py``); ``staleness`` overrides
the mode's bound. With ``params`` (a preset, ``bench/sim/perf.py``) ``sync`` is colocated: every GPU generates
(``gpus / generation_tp`` engines), then all ``gpus`` train; ``async`` splits them (``async_generation_gpus``
generate, the rest train) at the preset's ``staleness``, with at most ``max_inflight_prompts`` prompts generating.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.sim.model import FleetModel
from bench.sim.perf import SimParams
from producers.flow import quota_phase
from streamforge.audit import run_audit
from streamforge.brokers import EmbeddedBrokers
from streamforge.config import dump_config, load_config
from topics.admin import ensure_topics, group_offsets, highwaters

ROOT = Path(__file__).resolve().parents[2]
STALENESS = {"sync": 0, "async": 4, "unbounded": -1}
_ASSIGNED = re.compile(r"assigned \[([0-9, ]*)\];")
_TICK = os.sysconf("SC_CLK_TCK")
AUDIT_KEYS = ("produced", "duplicate_records", "batched", "batches", "dropped", "pending", "lost",
              "batched_and_dropped", "in_two_batches", "trained_steps", "trained", "trained_twice", "stale_batches", "stale_fraction", "reconciles")


@dataclass(kw_only=True)
class FleetRun:
    generators: int
    mode: str = "async"
    model: FleetModel = field(default_factory=FleetModel)
    processes: int = 2  # generator processes
    buffers: int = 1  # buffer processes (= episodes partitions)
    groups_per_batch: int = 64
    warmup_s: float = 8.0  # real seconds before the measurement window
    measure_s: float = 30.0  # real seconds measured
    seed: int = 0
    audit: bool = True
    overrides: list[str] = field(default_factory=list)  # more --section.key=value for the run config
    staleness: int | None = None  # staleness.max_versions instead of the mode's
    params: SimParams | None = None  # a preset: engines, trainer and lengths from bench/sim/perf.py
    steps: int = 0  # with params: run until the trainer trained this many steps
    time_scale: float = 10.0  # with params (a FleetModel carries its own)
    token_scale: int = 1  # with params: simulated tokens per token an Episode carries

    @property
    def bound(self) -> int:
        if self.staleness is not None:
            return self.staleness
        if self.params is not None and self.mode == "async":
            return self.params.staleness
        return STALENESS[self.mode]

    @property
    def engines(self) -> int:
        """Simulated generators: with a preset, its engines of the mode."""
        if self.params is None:
            return self.generators
        p = self.params
        return (p.gpus if self.mode == "sync" else p.async_generation_gpus) // p.generation_tp

    @property
    def train_gpus(self) -> int:
        p = self.params
        assert p is not None
        return p.gpus if self.mode == "sync" else p.gpus - p.async_generation_gpus

    @property
    def max_inflight(self) -> int:
        return self.params.inflight_cap if self.params is not None and self.mode != "sync" else 0

    @property
    def sim_time_scale(self) -> float:
        return self.time_scale if self.params is not None else self.model.time_scale

    def speed_spec(self) -> dict[str, Any]:
        """What the child processes build their simulated GPU from (``generators.speed_of``)."""
        if self.params is None:
            return {"model": self.model.to_dict()}
        return {"params": self.params.to_dict(), "time_scale": self.time_scale, "token_scale": self.token_scale,
                "train_gpus": self.train_gpus, "max_inflight": self.max_inflight}


def cpu_s(pid: int) -> float:
    """utime + stime of one process (``/proc/<pid>/stat``), 0 when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0.0
    fields = raw[raw.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def run_config(run: FleetRun, brokers: EmbeddedBrokers, run_dir: Path) -> Any:
    p = run.params
    if p is None:
        m = run.model
        concurrent, group, groups, row = m.max_concurrent_prompts, m.group_size, run.groups_per_batch, (
            m.length_cap + m.prompt_max)
        extra = []
    else:  # a preset: one batch of its groups, every group trained (AReaL trains zero-variance groups too)
        concurrent, group, groups = math.ceil(p.inflight_cap / run.engines), p.samples_per_prompt, p.prompts_per_step
        row = math.ceil((p.response_tokens.cap + p.prompt_tokens.max) / run.token_scale) + 2
        extra = ["--buffer.filter_zero_variance=false"]
    pending = max(4096, 2 * run.engines * concurrent * group)
    # a sync step waits for its slowest group: the batch and group deadlines are the real seconds of a long step
    wait_s = 60 if p is None else max(60, math.ceil(4 * p.response_tokens.cap * 0.02 / run.sim_time_scale))
    return load_config(None, [
        f"--run.prefix=scale{os.getpid()}{run.mode}{run.engines}", f"--run.run_dir={run_dir}",
        f"--run.seed={run.seed}", f"--kafka.bootstrap={brokers.kafka_bootstrap}", f"--nats.url={brokers.nats_url}",
        "--telemetry.traces=none", f"--staleness.max_versions={run.bound}",
        f"--trainer.publish_busy={'wait' if run.bound == 0 else 'skip'}",
        f"--up.generators={run.engines}", f"--up.buffers={run.buffers}",
        f"--topics.episodes_partitions={run.buffers}", f"--buffer.groups_per_batch={groups}",
        "--buffer.batching=pack", f"--buffer.pack_row_tokens={row}",
        # a batch waits for its groups (the trainer's step needs them all), not for a real-time deadline that
        # the time scale would turn into a cut of every sync batch
        f"--buffer.max_batch_wait_s={wait_s}", f"--buffer.group_timeout_s={2 * wait_s}",
        f"--buffer.max_pending_episodes={pending}",
        f"--generator.max_concurrent_prompts={concurrent}", f"--generator.group_size={group}",
        # the feeder keeps the topic a few rounds of prompts ahead of what the generators hold
        f"--feeder.max_in_flight={max(64, 4 * run.engines * concurrent)}", *extra,
        *run.overrides,
    ], environ={})


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:] if path.exists() else ""


async def _wait_assigned(logs: list[Path], procs: list[subprocess.Popen], partitions: int) -> None:
    """Until the buffers' latest assignments split the partitions, twice in a row half a second apart."""
    deadline = time.monotonic() + 60 + 30 * len(procs)
    settled = None
    while True:
        latest = []
        for path in logs:
            found = _ASSIGNED.findall(path.read_text(errors="replace"))
            latest.append(sorted(int(p) for p in found[-1].split(",") if p.strip()) if found else [])
        if sorted(p for parts in latest for p in parts) == list(range(partitions)) and all(latest):
            if settled == latest:
                return
            settled = latest
        else:
            settled = None
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError("buffers not ready:\n" + "\n".join(_tail(p) for p in logs))
        await asyncio.sleep(0.5)


async def _start_child(module: str, spec: dict, workdir: Path, name: str) -> subprocess.Popen:
    spec_path = workdir / f"{name}.json"
    spec_path.write_bytes(orjson.dumps(spec))
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:  # noqa: ASYNC230 - before the measurement
        proc = subprocess.Popen([sys.executable, "-m", module, str(spec_path)], cwd=ROOT,  # noqa: ASYNC220
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while b"ready" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start:\n{_tail(log)}")
        await asyncio.sleep(0.1)
    return proc


def _stop(procs: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def _role(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "streamforge", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def ledger_steps(run_dir: Path) -> int:
    path = Path(run_dir) / "trainer" / "ledger.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def gap_counters(run_dir: Path) -> dict[str, float]:
    """The buffer's offset-gap counters: every ``offset_gap*`` key of the last row of ``metrics-buffer.jsonl`` (its
    final flush at stop; the rows name no process, so with several buffers this is the last one to stop)."""
    last: dict[str, Any] = {}
    path = Path(run_dir) / "metrics-buffer.jsonl"
    for line in path.read_bytes().splitlines() if path.exists() else ():
        try:
            last = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
    return {key.split("/", 1)[-1]: value for key, value in last.items() if "offset_gap" in key}


async def run_fleet(run: FleetRun, workdir: Path) -> dict[str, Any]:
    """One run (module docstring); returns its figures (``summarize`` or ``summarize_steps``) with the audit."""
    workdir.mkdir(parents=True, exist_ok=True)
    brokers = EmbeddedBrokers(workdir / "brokers")
    await brokers.start()
    procs: list[subprocess.Popen] = []
    try:
        cfg = run_config(run, brokers, workdir / "run")
        await ensure_topics(cfg.kafka, cfg.names, cfg.topics)
        cfg_path = workdir / "run.yaml"
        cfg_path.write_text(dump_config(cfg))
        buf_logs = [workdir / f"buffer{i}.log" for i in range(run.buffers)]
        buffers = [_role(["run", "buffer", "--config", str(cfg_path)], path) for path in buf_logs]
        procs += buffers
        feeder = _role(["run", "feeder", "--config", str(cfg_path)], workdir / "feeder.log")
        procs.append(feeder)
        await _wait_assigned(buf_logs, buffers, run.buffers)
        base = {"config": str(cfg_path), **run.speed_spec(), "seed": run.seed}
        trainer = await _start_child("bench.sim.trainer", {**base, "stats": str(workdir / "trainer.stats")},
                                     workdir, "trainer")
        procs.append(trainer)
        ids = [f"sim{i}" for i in range(run.engines)]
        nproc = max(1, min(run.processes, run.engines))
        gens = []
        for p in range(nproc):
            spec = {**base, "seed": run.seed * 1000 + p, "process": p, "ids": ids[p::nproc],
                    "stats": str(workdir / f"gen{p}.stats")}
            gens.append(await _start_child("bench.sim.generators", spec, workdir, f"gen{p}"))
        procs += gens
        for g in gens:  # every process is in the generators group: generate
            g.send_signal(signal.SIGUSR1)
        roles = {"broker": brokers._procs["tansu"].pid, "nats": brokers._procs["nats"].pid,
                 "trainer": trainer.pid, "feeder": feeder.pid, **{f"buffer{i}": b.pid for i, b in enumerate(buffers)},
                 **{f"gen{i}": g.pid for i, g in enumerate(gens)}}
        watched = (("trainer", trainer), ("feeder", feeder), *((f"gen{i}", g) for i, g in enumerate(gens)),
                   *((f"buffer{i}", b) for i, b in enumerate(buffers)))

        def check() -> None:
            dead = [k for k, p in watched if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited:\n" + "\n".join(_tail(workdir / f"{k}.log") for k in dead))

        stalls = False
        if run.params is None:
            # a fleet whose quotas all floor to no group at all (a share of a step too small for any generator's
            # phase, producers/flow.py) takes nothing until the quota's liveness guard grants one (30 s before two
            # versions were seen): the window starts after that
            g = cfg.generator
            stalls = g.groups_per_step > 0 and all(
                math.floor(g.quota_window_steps * g.groups_per_step + quota_phase(i) + 1e-9) == 0 for i in ids)
            await asyncio.sleep(run.warmup_s + (32.0 if stalls else 0.0))

            async def snapshot() -> tuple[float, dict[str, float], int, int, int]:
                """Time, CPU seconds per process, episodes on the topic, buffers' committed offsets, and the
                episodes the buffers decided: batch records x groups_per_batch plus drop records (one a group), x
                group size."""
                t = time.time()
                cpu = {k: cpu_s(pid) for k, pid in roles.items()}
                hw = sum((await highwaters(cfg.kafka, cfg.names.episodes)).values())
                done = sum((await group_offsets(cfg.kafka, cfg.names.buffers_group, cfg.names.episodes)).values())
                batches = sum((await highwaters(cfg.kafka, cfg.names.batches)).values())
                drops = sum((await highwaters(cfg.kafka, cfg.names.drops)).values())
                return t, cpu, hw, done, (batches * run.groups_per_batch + drops) * run.model.group_size

            start = await snapshot()
            deadline = time.monotonic() + run.measure_s
            while time.monotonic() < deadline:
                await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                check()
            end = await snapshot()
        else:  # until the trainer trained `steps` steps (the ledger has a line per step)
            cpu0 = {k: cpu_s(pid) for k, pid in roles.items()}
            deadline = time.monotonic() + run.measure_s
            while ledger_steps(cfg.run.run_dir) < run.steps:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{ledger_steps(cfg.run.run_dir)} of {run.steps} steps in {run.measure_s} s:"
                                       f"\n{_tail(workdir / 'trainer.log')}")
                await asyncio.sleep(0.5)
                check()
            cpu = {k: round(cpu_s(pid) - cpu0[k], 3) for k, pid in roles.items()}
        _stop(gens)
        _stop([trainer])
        _stop([feeder])
        _stop(buffers)  # SIGTERM: each drains (publishes what it holds, commits)
        gen_stats = [orjson.loads((workdir / f"gen{p}.stats").read_bytes()) for p in range(nproc)]
        trainer_stats = orjson.loads((workdir / "trainer.stats").read_bytes())
        audit = await run_audit(cfg) if run.audit else None
        if run.params is None:
            result = summarize(run, start, end, gen_stats, trainer_stats, audit)
        else:
            result = summarize_steps(run, gen_stats, trainer_stats, audit, cpu)
        result["quota_floor_stall"] = stalls
        result["gaps"] = gap_counters(cfg.run.run_dir)
        return result
    finally:
        _stop(procs, 10)
        brokers.stop()


def summarize(run: FleetRun, start: tuple, end: tuple, gens: list[dict], trainer: dict,
              audit: dict | None) -> dict[str, Any]:
    """The run's figures: simulated rates per simulated second, real counts and CPU per real second/episode."""
    k = run.model.time_scale
    (t0, cpu0, hw0, done0, decided0), (t1, cpu1, hw1, done1, decided1) = start, end
    wall = t1 - t0
    steps = trainer["steps"]
    busy = sum(_overlap(a, b, t0, t1) for a, b, *_ in steps)
    tokens = sum(tok * _overlap(a, b, t0, t1) / max(b - a, 1e-9) for a, b, tok, *_ in steps)
    cpu = {key: round(cpu1[key] - cpu0[key], 3) for key in cpu0}
    processed = decided1 - decided0
    buffer_cpu = sum(v for key, v in cpu.items() if key.startswith("buffer"))
    hist = {int(s): n for s, n in trainer["staleness"].items()}
    total = sum(hist.values()) or 1
    gen = {key: sum(g[key] for g in gens) for key in gens[0] if isinstance(gens[0][key], (int, float))}
    sim_gen_s = sum(g["wall_s"] for g in gens) / len(gens) * k
    out: dict[str, Any] = {
        "mode": run.mode, "generators": run.generators, "buffers": run.buffers, "time_scale": k,
        "window_real_s": round(wall, 2),
        "trained_tokens_per_sim_s": round(tokens / (wall * k), 1),
        "trainer_busy": round(busy / wall, 3),
        "steps_in_window": sum(1 for _, b, *_ in steps if t0 <= b <= t1),
        "steps": len(steps), "versions_published": len(trainer["publications"]),
        "stale_batches": trainer["stale_batches"],
        "staleness_tokens": dict(sorted(hist.items())),
        "staleness_mean": round(sum(s * n for s, n in hist.items()) / total, 3),
        "staleness_max": max(hist, default=0),
        "episodes_offered_per_real_s": round((hw1 - hw0) / wall, 1),
        "episodes_decided_per_real_s": round(processed / wall, 1),
        # records not yet committed by the buffers: grows when they hold groups for the trainer (max_batches_ahead)
        # or cannot keep up
        "uncommitted_growth": (hw1 - done1) - (hw0 - done0),
        "cpu_s": cpu, "cpu_per_real_s": {key: round(v / wall, 3) for key, v in cpu.items()},
        "buffer_us_per_episode": round(1e6 * buffer_cpu / processed, 1) if processed else None,
        "broker_us_per_episode": round(1e6 * cpu["broker"] / processed, 1) if processed else None,
        "generator_gpu_utilization": round(gen["tokens"] / (run.generators * run.model.tokens_per_s * sim_gen_s), 3),
        "generator": {key: (round(v, 1) if isinstance(v, float) else v) for key, v in gen.items()
                      if key not in ("process",)},
        "failures": [f for g in gens for f in g["failures"]] + ([trainer["failure"]] if trainer["failure"] else []),
    }
    if audit is not None:
        out["audit"] = audit_figures(audit)
    return out


def audit_figures(audit: dict) -> dict[str, Any]:
    """The audit's keys the bench reports; ``lost`` counts episodes and, where the audit reconciles prompts
    (``audit["prompts"]``), prompts too."""
    out = {key: audit[key] for key in AUDIT_KEYS if key in audit}
    out["lost_sample"] = audit["samples"]["lost"]
    if "prompts" in audit:
        out["prompts"] = audit["prompts"]
    return out


def lost(result: dict) -> int:
    """Episodes and prompts the run's audit found lost (its top-level ``lost``; without a prompt reconcile, the
    episodes only)."""
    audit = result.get("audit") or {}
    return int(audit.get("lost", 0))


SKIP_STEPS = 2  # steps before a preset run's measurement: the pipeline fills (the first batch waits for all of it)


def summarize_steps(run: FleetRun, gens: list[dict], trainer: dict, audit: dict | None,
                    cpu: dict[str, float]) -> dict[str, Any]:
    """A preset run's figures, in simulated seconds, over the steps after the first ``SKIP_STEPS``."""
    k = run.sim_time_scale
    steps = trainer["steps"]
    measured = steps[SKIP_STEPS:]
    if len(measured) < 2:
        raise RuntimeError(f"{len(steps)} steps: too few to measure after {SKIP_STEPS}")
    t0, t1 = measured[0][1], measured[-1][1]
    busy = sum(_overlap(a, b, t0, t1) for a, b, *_ in measured[1:])
    tokens = sum(tok for _, _, tok, *_ in measured[1:])
    hist = {int(s): n for s, n in trainer["staleness"].items()}
    total = sum(hist.values()) or 1
    gen = {key: sum(g[key] for g in gens) for key in gens[0] if isinstance(gens[0][key], (int, float))}
    out: dict[str, Any] = {
        "mode": run.mode, "staleness_bound": run.bound, "engines": run.engines, "train_gpus": run.train_gpus,
        "time_scale": k, "token_scale": run.token_scale, "steps": len(steps), "measured_steps": len(measured) - 1,
        "s_per_step": round((t1 - t0) * k / (len(measured) - 1), 2),
        "step_intervals_s": [round((b[1] - a[1]) * k, 1) for a, b in itertools.pairwise(measured)],
        "trained_tokens_per_sim_s": round(tokens / ((t1 - t0) * k), 1),
        "trainer_busy": round(busy / (t1 - t0), 3),
        "versions_published": len(trainer["publications"]), "stale_batches": trainer["stale_batches"],
        "staleness_mean": round(sum(s * n for s, n in hist.items()) / total, 3),
        "staleness_max": max(hist, default=0),
        "cpu_s": cpu,
        "generator": {key: (round(v, 1) if isinstance(v, float) else v) for key, v in gen.items()
                      if key not in ("process",)},
        "failures": [f for g in gens for f in g["failures"]] + ([trainer["failure"]] if trainer["failure"] else []),
    }
    if audit is not None:
        out["audit"] = audit_figures(audit)
    return out

