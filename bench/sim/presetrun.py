"""``bench/scale.py --params FILE``: a preset (``bench/sim/perf.py``) through the real pipeline, against its paper.

The fleet and the batch are divided by ``--scale`` together (``perf.scaled``: 512 prompts on 128 GPUs at 16 is 32
prompts on 8 GPUs, the same requests per GPU), simulated time runs ``--time-scale`` times faster than real time,
and an Episode carries one token for every ``--token-scale`` simulated tokens (the simulated GPUs and trainer
count every simulated token; the brokers and the buffer carry the fewer), so a 27k-token run fits a small host.
Each run trains ``--steps`` steps on fresh brokers; the first ``fleet.SKIP_STEPS`` fill the pipeline and are not
measured.

Runs, the order alternating over ``--runs``: ``sync`` (colocated: all GPUs generate the batch, then all train),
``async`` (``async_generation_gpus`` generate at the preset's ``staleness``, the rest train), and ``eta0`` (the
async split at staleness 0: AReaL's own synchronous baseline, section 4.1: "when eta = 0, our system degenerates
to synchronous RL"); with ``--eta``, one async run per bound at the paper's eta-curve cap
(``paper.eta_response_cap``). Beside them the pure model (``bench/sim/fleetsim.py``) predicts the same figures at
full scale and at the run's scale: the scale-down check.

Last line: ``preset``, ``paper_async_vs_sync``, ``sim_async_vs_sync``, ``sync_s_per_step``, ``async_s_per_step``
(simulated seconds a step, full-scale figures: the scale-down keeps a step's time), ``trainer_busy_async``,
``lost`` (episodes and prompts, summed over every run), then ``sim_async_vs_eta0``, ``offset_gaps``, ``runs``,
``scale``, the pure model's ratios, and ``eta`` (paper against simulated, k tokens/s, per bound) when run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.sim.fleet import FleetRun, lost, run_fleet
from bench.sim.fleetsim import eta_curve, predict
from bench.sim.perf import Perf, SimParams, length_stats, load_params, scaled


def _run(params: SimParams, mode: str, args: argparse.Namespace, staleness: int | None = None) -> FleetRun:
    return FleetRun(generators=0, mode=mode, params=params, staleness=staleness, steps=args.steps,
                    time_scale=args.time_scale, token_scale=args.token_scale, processes=1, measure_s=args.max_run_s,
                    seed=args.seed, overrides=[f"--{s}" for s in args.set])


def _median(results: list[dict], key: str) -> dict:
    ordered = sorted(results, key=lambda r: r[key])
    return ordered[len(ordered) // 2]


def _eta_params(params: SimParams) -> SimParams:
    cap = params.paper.eta_response_cap
    return replace(params, response_tokens=replace(params.response_tokens, cap=cap)) if cap else params


async def preset_sweep(args: argparse.Namespace) -> dict[str, Any]:
    full = load_params(args.params, args.param)
    params = scaled(full, args.scale)
    workdir = Path(tempfile.mkdtemp(prefix="bench-scale-params-"))
    runs: dict[str, list[dict]] = {}
    for r in range(args.runs):
        modes = ["sync", "async", "eta0"]
        for mode in modes if r % 2 == 0 else modes[::-1]:
            run = _run(params, "async" if mode == "eta0" else mode, args, 0 if mode == "eta0" else None)
            result = await run_fleet(run, workdir / f"{mode}-{r}")
            result.update(run=r, label=mode)
            runs.setdefault(mode, []).append(result)
            print(json.dumps(result), flush=True)
    etas: dict[str, dict] = {}
    eta_scaled = _eta_params(params)
    for eta in args.eta:
        bound = -1 if eta == "inf" else int(eta)
        result = await run_fleet(_run(eta_scaled, "async", args, bound), workdir / f"eta{eta}")
        result.update(run=0, label=f"curve-eta{eta}")
        etas[eta] = result
        print(json.dumps(result), flush=True)
    return {"full": full, "params": params, "runs": runs, "etas": etas}


def preset_report(out: dict[str, Any], args: argparse.Namespace) -> tuple[dict, dict]:
    """The summary (the pure model, the lengths, the eta curve, per-run gaps) and the last line."""
    full, params, runs, etas = out["full"], out["params"], out["runs"], out["etas"]
    sync = _median(runs["sync"], "s_per_step")
    asyn = _median(runs["async"], "s_per_step")
    eta0 = _median(runs["eta0"], "s_per_step")
    every = [r for results in runs.values() for r in results] + list(etas.values())
    model_full = predict(full, steps=args.model_steps)
    model_scaled = predict(params, steps=args.model_steps)
    summary: dict[str, Any] = {
        "preset": full.name, "source": full.paper.source, "scale": args.scale,
        "scaled_fleet": {"gpus": params.gpus, "async_generation_gpus": params.async_generation_gpus,
                         "prompts_per_step": params.prompts_per_step, "samples_per_prompt": params.samples_per_prompt,
                         "max_inflight_prompts": params.inflight_cap},
        "time_scale": args.time_scale, "token_scale": args.token_scale, "steps": args.steps,
        "lengths": length_stats(full), "lengths_at_8k": length_stats(full, 8192), "speeds": Perf(full).describe(),
        "model_full_scale": model_full, "model_scaled": model_scaled,
        "model_eta0_full_scale": predict(replace(full, staleness=0), steps=args.model_steps)["async_s_per_step"],
        "runs": [{"label": r["label"], "run": r["run"], "s_per_step": r["s_per_step"],
                  "trainer_busy": r["trainer_busy"], "staleness_mean": r["staleness_mean"], "lost": lost(r),
                  "gaps": r["gaps"]} for r in every],
    }
    if full.paper.sync_hours:
        summary["paper_s_per_step"] = {"sync": round(full.paper.sync_hours * 3600 / full.steps, 1),
                                       "async": round(full.paper.async_hours * 3600 / full.steps, 1)}
    final: dict[str, Any] = {
        "bench": "scale", "preset": full.name, "paper_async_vs_sync": full.paper.async_vs_sync,
        "sim_async_vs_sync": round(sync["s_per_step"] / asyn["s_per_step"], 3),
        "sync_s_per_step": sync["s_per_step"], "async_s_per_step": asyn["s_per_step"],
        "trainer_busy_async": asyn["trainer_busy"],
        "lost": sum(lost(r) for r in every),
        "sim_async_vs_eta0": round(eta0["s_per_step"] / asyn["s_per_step"], 3),
        "eta0_s_per_step": eta0["s_per_step"],
        "model_async_vs_sync": model_full["async_vs_sync"],
        "model_async_vs_sync_scaled": model_scaled["async_vs_sync"],
        "model_async_vs_eta0": round(summary["model_eta0_full_scale"] / model_full["async_s_per_step"], 3),
        "offset_gaps": sum(r["gaps"].get("offset_gaps", 0) for r in every), "runs": len(every),
        "scale": args.scale,
    }
    if etas:
        paper = full.paper.eta_throughput_k
        # trained tokens per simulated second of the scaled fleet, times the scale: the full fleet's
        sim = {eta: round(r["trained_tokens_per_sim_s"] * args.scale / 1000, 1) for eta, r in etas.items()}
        base = sim.get("0")
        final["eta"] = {eta: {"paper_k_tokens_s": paper.get(eta), "sim_k_tokens_s": v,
                              "sim_vs_eta0": round(v / base, 3) if base else None} for eta, v in sim.items()}
        values = [sim[e] for e in args.eta]
        final["eta_monotone"] = all(b >= a * 0.98 for a, b in itertools.pairwise(values))
        if args.eta_model:
            model = eta_curve(_eta_params(full), [-1 if e == "inf" else int(e) for e in args.eta])
            summary["model_eta_k_tokens_s"] = {e: round(v / 1000, 1) for e, v in model.items()}
    return summary, final


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--params (a preset through the pipeline, against its paper)")
    g.add_argument("--params", metavar="FILE", help="a preset: bench/sim/presets/*.yaml or a path")
    g.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="override a preset key")
    g.add_argument("--scale", type=int, default=8, help="divide the fleet and the batch by this (default 8)")
    g.add_argument("--token-scale", type=int, default=16, help="simulated tokens per token an Episode carries")
    g.add_argument("--steps", type=int, default=8, help="trainer steps per run (the first 2 are not measured)")
    g.add_argument("--eta", nargs="*", default=[], metavar="ETA", help="an async run per staleness bound "
                   "(integers or inf) at the paper's eta-curve cap, e.g. --eta 0 1 2 4 8 16 inf")
    g.add_argument("--eta-model", action="store_true", help="also the pure model's eta curve at full scale")
    g.add_argument("--model-steps", type=int, default=8, help="steps of the pure model's predictions")
    g.add_argument("--max-run-s", type=float, default=900.0, help="real seconds a run may take")
