"""Benchmark: a simulated GPU fleet on the real brokers, buffer and audit; synchronous vs asynchronous training.

Only the GPUs are simulated (``bench/sim/``): generators sleep as a GPU decoding with continuous batching would,
then produce real Episodes (real token arrays, rewards from a stated distribution) through the real producer path;
a trainer sleeps a step time proportional to each real Batch's tokens and publishes real policy versions on NATS;
a weight swap pauses a generator for model size / bandwidth. The embedded brokers (Tansu, nats-server), the
buffer processes (``streamforge run buffer``), the staleness bounds every role derives from
``staleness.max_versions`` and the audit are the real ones. Many simulated generators share a process (asyncio),
``--processes`` processes share the fleet.

The simulation is time-scaled: ``--time-scale`` simulated seconds pass per real second (default 10). Rates of the
simulation (trained tokens per simulated second, busy fractions, staleness) are in simulated time; figures of real
components (bytes, messages, episodes per real second, CPU seconds, microseconds per episode) are measured and never
scaled. ``bench/sim/model.py`` states every distribution and speed; the defaults: response lengths lognormal
(median 512 tokens, log-sd 0.9, capped at 4096), prompts 64-256 tokens, a prompt's success probability
Beta(2, 2), groups of 4; a generator GPU decodes 3,000 tokens/s at a full batch and one sequence at most
100 tokens/s, at most 16 groups at once; a swap moves 14 GB at 25 GB/s; the trainer trains 20,000 tokens/s;
64 groups per batch.

For each fleet size (``--generators``, default 4 16 64 256), one run per mode on fresh brokers, same fleet and
seed, the order alternating:

* ``sync``: ``staleness.max_versions: 0``, ``trainer.publish_busy: wait`` (each batch from the latest weights);
* ``async``: ``staleness.max_versions: 4`` (the default bound), ``publish_busy: skip``.

Each run measures a window after a warm-up (32 s longer where every generator's quota floors to no group and only
the quota's liveness guard lets prompts through; the quota's phases make that rare: with 256 generators and 64
groups per batch each takes a quarter of a group per step, one group every four steps at staggered steps,
``producers/flow.py``; the run reports ``quota_floor_stall``): trained tokens per simulated second, trainer busy
fraction, the staleness of every trained token (a histogram), episodes per real second offered and consumed, CPU
seconds of every process (broker, NATS, buffers, trainer, generator processes), buffer and broker CPU per episode;
then the audit reconciles produced = batched + dropped + pending, nothing lost or trained twice.

Buffer capacity: ``unbounded`` runs (``staleness.max_versions: -1``: no quota, every generator at its full rate;
a trainer that takes no time) of ``--capacity-generators`` generators at ``--capacity-time-scale``, with one and
with two buffer processes (one ``episodes`` partition each). A buffer process runs one Python event loop: it
sustains at most ``1e6 / buffer_us_per_episode`` episodes per real second on its core, and a saturated generator
makes ``tokens_per_s / mean response length`` episodes per second, so ``max_generators_one_buffer`` is
``floor(that / this)`` at real (unscaled) speed, from the CPU per episode (batch and drop records the buffers
decided in the window, times their episodes) of the one-buffer capacity run. The two-buffer run splits the episodes
between two processes at about the same cost each, so the bound grows with the processes
(``max_generators_two_buffers`` in the summary line) until the next bound, the broker's CPU per episode
(``max_generators_one_broker_core``: Tansu per core). On a small host the simulated generators' own CPU may cap the
offered load before any of these; the per-process CPU per real second shows which.

Prompts come from the real feeder (``streamforge run feeder``) through the ``prompts`` topic: each generator process
is one member of the ``generators`` group and commits a prompt once its group is on the broker
(``bench/sim/prompts.py``), so the audit's reconcile covers them. ``--runs K`` repeats every mode and size on
fresh brokers; each run's output carries the buffer's offset-gap counters (``gaps``).

Usage: ``python bench/scale.py [--quick] [--generators 4 16 64 256] [--runs K] [--measure-s S] [--warmup-s S]
[--processes P] [--time-scale K] [--set SECTION.KEY=VALUE ...] [--model KEY=VALUE ...]``. Last line: ``{"bench":
"scale", "generators": [..], "async_vs_sync": X, "trainer_busy_async": Y, "trainer_busy_sync": Z,
"max_generators_one_buffer": N, "buffer_us_per_episode": U, "lost": L, "offset_gaps": G, "runs": R}`` (the first
three at 64 generators, the median run of each mode; goals: ``async_vs_sync >= 2.5``, ``trainer_busy_async >=
0.95``; ``lost``: episodes and prompts the audits found lost, summed over every run; ``offset_gaps`` summed).

A preset instead (``bench/sim/presetrun.py``, ``bench/sim/perf.py``): ``python bench/scale.py --params
bench/sim/presets/areal-1.5b.yaml [--scale 8] [--steps 8] [--token-scale 16] [--time-scale 20] [--runs K]
[--eta 0 1 2 4 8 16 inf] [--param KEY=VALUE ...]`` runs a published run's setting (every parameter from the YAML,
every speed derived by the stated model) through the same pipeline, colocated sync against AReaL's async split,
the batch and the fleet scaled down together. Last line: ``preset``, ``paper_async_vs_sync``,
``sim_async_vs_sync``, ``sync_s_per_step``, ``async_s_per_step``, ``trainer_busy_async``, ``lost`` and more
(``bench/sim/presetrun.py`` lists them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sim.fleet import FleetRun, lost, run_fleet
from bench.sim.model import FleetModel
from bench.sim.presetrun import add_arguments, preset_report, preset_sweep


def _model(pairs: list[str], time_scale: float) -> FleetModel:
    model = FleetModel(time_scale=time_scale)
    for pair in pairs:
        key, _, value = pair.partition("=")
        current = getattr(model, key)
        setattr(model, key, type(current)(value))
    return model


def _line(result: dict) -> str:
    keys = ("mode", "generators", "buffers", "trained_tokens_per_sim_s", "trainer_busy", "staleness_mean",
            "staleness_max", "episodes_decided_per_real_s", "buffer_us_per_episode", "broker_us_per_episode",
            "generator_gpu_utilization", "cpu_per_real_s", "audit")
    return json.dumps({k: result.get(k) for k in keys} | {"run": result.get("run", 0)})


async def sweep(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    model = _model(args.model, args.time_scale)
    base = FleetRun(generators=0, model=model, processes=args.processes, groups_per_batch=args.groups_per_batch,
                    warmup_s=args.warmup_s, measure_s=args.measure_s, seed=args.seed,
                    overrides=[f"--{s}" for s in args.set])
    runs: dict[tuple[str, int], list[dict]] = {}
    for i, n in enumerate(args.generators):
        for r in range(args.runs):
            for mode in (("sync", "async") if (i + r) % 2 == 0 else ("async", "sync")):
                result = await run_fleet(replace(base, generators=n, mode=mode), workdir / f"{mode}{n}-{r}")
                result["run"] = r
                runs.setdefault((mode, n), []).append(result)
                print(json.dumps(result), flush=True)
    levers = []
    at = 64 if 64 in args.generators else max(args.generators)
    for lever in args.lever:
        sets = [f"--{item}" for item in lever.split(",")]
        run = replace(base, generators=at, mode="async", overrides=base.overrides + sets)
        result = await run_fleet(run, workdir / f"lever{len(levers)}")
        result["lever"] = lever
        levers.append(result)
        print(json.dumps(result), flush=True)
    capacity = []
    if args.capacity_generators:
        cap_model = replace(model, time_scale=args.capacity_time_scale, trainer_tokens_per_s=1e12)
        for buffers in (1, 2):
            result = await run_fleet(replace(base, generators=args.capacity_generators, mode="unbounded",
                                             model=cap_model, buffers=buffers, audit=False,
                                             measure_s=min(args.measure_s, 15.0)),
                                     workdir / f"capacity{buffers}")
            capacity.append(result)
            print(json.dumps(result), flush=True)
    return {"runs": runs, "capacity": capacity, "levers": levers, "model": model}


def _median_run(results: list[dict]) -> dict:
    """The run of median trained-token rate among a mode's runs."""
    ordered = sorted(results, key=lambda r: r["trained_tokens_per_sim_s"])
    return ordered[len(ordered) // 2]


def report(out: dict, generators: list[int]) -> dict:
    capacity, model = out["capacity"], out["model"]
    every = [r for results in out["runs"].values() for r in results] + out["levers"] + capacity
    runs = {key: _median_run(results) for key, results in out["runs"].items()}
    at = 64 if 64 in generators else max(generators)
    sync, asyn = runs[("sync", at)], runs[("async", at)]
    per_gen = model.episodes_per_s_per_generator()
    summary: dict = {"at_generators": at, "episodes_per_s_per_generator": round(per_gen, 3),
                     "mean_response_tokens": round(model.mean_response_length(), 1),
                     "table": [_line(r) for results in out["runs"].values() for r in results],
                     "gaps": [{"mode": r["mode"], "generators": r["generators"], "run": r.get("run", 0),
                               "lost": lost(r), **r["gaps"]} for results in out["runs"].values() for r in results]}
    summary["levers"] = [{"set": r["lever"], "trainer_busy": r["trainer_busy"],
                          "trained_tokens_per_sim_s": r["trained_tokens_per_sim_s"],
                          "vs_sync": round(r["trained_tokens_per_sim_s"] / max(sync["trained_tokens_per_sim_s"], 1e-9), 3),
                          "staleness_mean": r["staleness_mean"], "staleness_max": r["staleness_max"],
                          "stale_fraction": r.get("audit", {}).get("stale_fraction")} for r in out["levers"]]
    source = capacity[0] if capacity else max(runs.values(), key=lambda r: r["episodes_decided_per_real_s"])
    u = source["buffer_us_per_episode"]
    if capacity:
        two = capacity[1]
        summary["capacity"] = [_line(r) for r in capacity]
        summary["buffer_cpu_per_real_s"] = [round(sum(v for k, v in r["cpu_per_real_s"].items()
                                                      if k.startswith("buffer")) / r["buffers"], 3)
                                            for r in capacity]
        if two["buffer_us_per_episode"]:
            summary["max_generators_two_buffers"] = math.floor(2 * 1e6 / two["buffer_us_per_episode"] / per_gen)
        if source["broker_us_per_episode"]:
            summary["max_generators_one_broker_core"] = math.floor(1e6 / source["broker_us_per_episode"] / per_gen)
    summary["final"] = {
        "bench": "scale", "generators": generators,
        "async_vs_sync": round(asyn["trained_tokens_per_sim_s"] / max(sync["trained_tokens_per_sim_s"], 1e-9), 3),
        "trainer_busy_async": asyn["trainer_busy"], "trainer_busy_sync": sync["trainer_busy"],
        "max_generators_one_buffer": math.floor(1e6 / u / per_gen) if u else None,
        "buffer_us_per_episode": u,
        "lost": sum(lost(r) for r in every), "offset_gaps": sum(r["gaps"].get("offset_gaps", 0) for r in every),
        "runs": len(every),
    }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 and 64 generators, short windows")
    parser.add_argument("--generators", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--processes", type=int, default=2, help="generator processes")
    parser.add_argument("--groups-per-batch", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=None,
                        help="simulated seconds per real second (default 10; 20 with --params)")
    parser.add_argument("--runs", type=int, default=1, help="runs of each mode and size, fresh brokers each")
    parser.add_argument("--warmup-s", type=float, default=6.0, help="real seconds before each window")
    parser.add_argument("--measure-s", type=float, default=30.0, help="real seconds measured per run")
    parser.add_argument("--capacity-generators", type=int, default=64, help="0: no buffer-capacity runs")
    parser.add_argument("--capacity-time-scale", type=float, default=40.0)
    parser.add_argument("--lever", action="append", default=None, metavar="KEY=VALUE[,KEY=VALUE]",
                        help="an extra async run at 64 generators with these overrides (repeatable); default: "
                             "the quota window one step narrower than the derived (S - G) x P + 1, "
                             "generator.quota_window_steps=3 (S=4), and S=8 (a derived window of 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                        help="a FleetModel field (bench/sim/model.py), e.g. length_cap=8192")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a run-config override for every run, e.g. buffer.groups_per_batch=32")
    add_arguments(parser)
    args = parser.parse_args()
    if args.params:
        args.time_scale = args.time_scale or 20.0
        summary, final = preset_report(asyncio.run(preset_sweep(args)), args)
        print(json.dumps(summary))
        print(json.dumps(final))
        return
    args.time_scale = args.time_scale or 10.0
    if args.lever is None:
        args.lever = ["generator.quota_window_steps=3", "staleness.max_versions=8"]
    if args.quick:
        args.generators, args.measure_s, args.warmup_s = [4, 64], 12.0, 5.0
        args.capacity_generators, args.lever = 64, args.lever[:1]
    out = asyncio.run(sweep(args))
    summary = report(out, args.generators)
    final = summary.pop("final")
    print(json.dumps(summary))
    print(json.dumps(final))


if __name__ == "__main__":
    main()
