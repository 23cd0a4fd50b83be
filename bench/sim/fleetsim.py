"""The performance model run as a pure, fast fleet simulation (no brokers): what ``bench/scale.py --params``
predicts, and what its pipeline runs are checked against.

Two modes over the same prompts in feed order (``perf.prompt_lengths``), so the same batches:

* ``sync`` (colocated, as Sync.AReaL and verl run): each step every engine (all ``gpus``) takes its share of the
  step's ``prompts_per_step`` groups (a group stays on one engine); the step's generation ends when the last
  response of the batch ends; then all ``gpus`` train on it; then the weights load into every engine.
* ``async`` (AReaL's split): ``async_generation_gpus / generation_tp`` engines generate continuously; the rest of
  the GPUs train. A prompt is admitted under AReaL's staleness rule ``floor((N_r - 1) / B) <= i + eta`` (``N_r``
  prompts admitted with it, ``B`` = ``prompts_per_step``, ``i`` the published version; ``eta`` = ``staleness``,
  none for ``-1``) while fewer than ``max_inflight_prompts`` are generating, to the engine running the fewest
  sequences whose KV pool holds it. The trainer takes the oldest ``B`` finished groups as soon as it is idle and
  they exist; a step's end publishes a version, and every engine pauses to load it (and to recompute its
  running sequences' KV under ``interrupt: recompute``).

The async clock advances in ticks of ``dt`` simulated seconds; in a tick every running sequence of an engine
advances ``dt / iteration_s`` tokens (from the engine's state at the tick's start), so a finish is placed within
its tick by interpolation. ``simulate`` returns per-step times and the figures the bench reports.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from bench.sim.perf import Perf, SimParams, prompt_lengths


@dataclass(slots=True)
class StepLog:
    """What a run did: each step's end time, the tokens it trained, and the busy seconds of each side."""

    ends: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # per trained group: versions between admission and training

    def s_per_step(self, skip: int) -> float:
        """Mean step interval after the first ``skip`` steps (the pipeline filling)."""
        ends = self.ends[skip:]
        if len(ends) < 2:
            raise ValueError("too few steps to measure")
        return (ends[-1] - ends[0]) / (len(ends) - 1)

    def summary(self, skip: int) -> dict[str, float]:
        per = self.s_per_step(skip)
        n = len(self.ends) - skip - 1
        done = len(self.ends)  # a step started but not finished has its tokens and time logged already
        tokens = sum(self.tokens[skip + 1:done])
        busy = sum(self.train_s[skip + 1:done])
        return {"s_per_step": round(per, 2), "tokens_per_s": round(tokens / (per * n), 1),
                "trainer_busy": round(busy / (per * n), 3), "steps": len(self.ends),
                "staleness_mean": round(float(np.mean(self.staleness)), 3) if self.staleness else 0.0}


def simulate_sync(params: SimParams, steps: int, perf: Perf | None = None) -> StepLog:
    """Synchronous colocated training (module docstring)."""
    perf = perf or Perf(params)
    engines = params.gpus // params.generation_tp
    B = params.prompts_per_step
    log = StepLog()
    t = 0.0
    for step in range(steps):
        batch = [prompt_lengths(params, step * B + k) for k in range(B)]
        gen = 0.0
        for e in range(engines):
            mine = batch[e::engines]
            if not mine:
                continue
            gen = max(gen, engine_batch_s(perf, mine))
        seqs = np.concatenate([p + lengths for p, lengths in batch])
        train = perf.train_s(seqs, params.gpus)
        t += gen + train + perf.weight_load_s
        log.ends.append(t)
        log.tokens.append(float(seqs.sum()))
        log.train_s.append(train)
        log.staleness.extend([0] * B)
    return log


def engine_batch_s(perf: Perf, groups: list[tuple[int, np.ndarray]]) -> float:
    """One engine decoding ``groups`` (prompt tokens, response lengths) started together, until the last ends."""
    prompts = np.concatenate([np.full(len(r), p, dtype=np.int64) for p, r in groups])
    lengths = np.concatenate([r for _, r in groups])
    prefill = sum(perf.prefill_s(np.array([p])) for p, _ in groups)
    k = np.arange(1, int(lengths.max()) + 1)  # iteration k decodes token k of every response longer than k - 1
    order = np.argsort(lengths)
    sl, sp = lengths[order], prompts[order]
    first = np.searchsorted(sl, k, side="left")  # sequences [first:] still running at iteration k
    running = len(sl) - first
    prompt_tail = np.concatenate([np.cumsum(sp[::-1])[::-1], [0]])[first]
    context = prompt_tail + (k - 1) * running
    return prefill + float(np.sum(perf.iteration_s(running, context)))


def simulate_async(params: SimParams, steps: int, perf: Perf | None = None, dt: float = 0.25) -> StepLog:
    """AReaL's asynchronous split (module docstring)."""
    perf = perf or Perf(params)
    engines = params.async_generation_gpus // params.generation_tp
    train_gpus = params.gpus - params.async_generation_gpus
    B, G = params.prompts_per_step, params.samples_per_prompt
    eta = None if params.staleness < 0 else params.staleness
    cap = params.inflight_cap
    # running sequences
    s_engine = np.zeros(0, dtype=np.int64)
    s_left = np.zeros(0)
    s_ctx = np.zeros(0)
    s_group = np.zeros(0, dtype=np.int64)
    g_left: dict[int, int] = {}  # group -> responses still decoding
    g_info: dict[int, tuple[int, np.ndarray, int]] = {}  # group -> (prompt, lengths, version at admission)
    done: deque[int] = deque()  # finished groups, oldest first
    paused_until = np.zeros(engines)
    admitted = 0
    version = 0
    train_end: float | None = None
    training: list[int] = []
    log = StepLog()
    t = 0.0
    while len(log.ends) < steps:
        # admission (AReaL's rule and cap)
        running_per = np.bincount(s_engine, minlength=engines)
        ctx_per = np.bincount(s_engine, weights=s_ctx, minlength=engines)
        while len(g_left) < cap and (eta is None or admitted // B <= version + eta):
            prompt, lengths = prompt_lengths(params, admitted)
            room = perf.kv_capacity - ctx_per - prompt * G
            ok = np.flatnonzero(room >= 0)
            if not len(ok):
                break
            e = int(ok[np.argmin(running_per[ok])])
            gid = admitted
            admitted += 1
            g_left[gid] = G
            g_info[gid] = (prompt, lengths, version)
            s_engine = np.concatenate([s_engine, np.full(G, e)])
            s_left = np.concatenate([s_left, lengths.astype(float)])
            s_ctx = np.concatenate([s_ctx, np.full(G, float(prompt))])
            s_group = np.concatenate([s_group, np.full(G, gid)])
            paused_until[e] = max(paused_until[e], t) + perf.prefill_s(np.array([prompt]))
            running_per[e] += G
            ctx_per[e] += prompt * G
        # decode one tick
        active = np.clip((t + dt - np.maximum(paused_until, t)) / dt, 0.0, 1.0)  # share of the tick not paused
        it = perf.iteration_s(running_per, ctx_per)
        rate = np.where(running_per > 0, dt * active / it, 0.0)  # tokens per sequence this tick, per engine
        step_tokens = rate[s_engine]
        finish = s_left <= step_tokens
        if finish.any():
            frac = np.where(step_tokens > 0, s_left / np.maximum(step_tokens, 1e-12), 0.0)
            for gid in s_group[finish][np.argsort(frac[finish], kind="stable")]:
                g_left[gid] -= 1
                if g_left[gid] == 0:
                    del g_left[gid]
                    done.append(int(gid))
        keep = ~finish
        s_ctx = (s_ctx + step_tokens)[keep]
        s_left = (s_left - step_tokens)[keep]
        s_engine, s_group = s_engine[keep], s_group[keep]
        t += dt
        # the trainer
        if train_end is not None and t >= train_end:
            version += 1
            log.ends.append(train_end)
            train_end = None
            for e in range(engines):
                pause = perf.weight_load_s
                if params.interrupt == "recompute":
                    pause += perf.prefill_s(s_ctx[s_engine == e])
                paused_until[e] = max(paused_until[e], t) + pause
        if train_end is None and len(done) >= B:
            training = [done.popleft() for _ in range(B)]
            seqs = np.concatenate([g_info[g][0] + g_info[g][1] for g in training])
            train = perf.train_s(seqs, train_gpus)
            train_end = t + train
            log.tokens.append(float(seqs.sum()))
            log.train_s.append(train)
            log.staleness.extend(version - g_info[g][2] for g in training)
            for g in training:
                del g_info[g]
    return log


def predict(params: SimParams, steps: int | None = None, skip: int = 2) -> dict[str, float]:
    """Both modes of the pure model: seconds a step and their ratio."""
    steps = steps or min(params.steps, 12)
    sync = simulate_sync(params, steps).summary(1)
    asyn = simulate_async(params, steps + skip).summary(skip)
    return {"sync_s_per_step": sync["s_per_step"], "async_s_per_step": asyn["s_per_step"],
            "async_vs_sync": round(sync["s_per_step"] / asyn["s_per_step"], 3),
            "trainer_busy_async": asyn["trainer_busy"], "trainer_busy_sync": sync["trainer_busy"],
            "async_tokens_per_s": asyn["tokens_per_s"], "sync_tokens_per_s": sync["tokens_per_s"],
            "staleness_mean_async": asyn["staleness_mean"]}


def eta_curve(params: SimParams, etas: list[int], steps: int = 10, skip: int = 2) -> dict[str, float]:
    """Effective training throughput (tokens/s) of the async split at each staleness bound (-1: none)."""
    out = {}
    for eta in etas:
        log = simulate_async(replace(params, staleness=eta), steps + skip)
        out["inf" if eta < 0 else str(eta)] = log.summary(skip)["tokens_per_s"]
    return out
