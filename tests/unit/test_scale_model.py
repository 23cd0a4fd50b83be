"""bench/scale.py's simulated GPU and its performance model: continuous batching shares a generator's rate, a swap
changes the version of the tokens that follow it, the stated length distributions hold, the roofline and FLOP rules
compute what their docstrings state, the presets load strictly, and the pure fleet model behaves as the paper's
systems do (a sync step waits for its longest response; the staleness bound opens the pipeline)."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from bench.sim.fleetsim import engine_batch_s, simulate_async, simulate_sync
from bench.sim.generators import Seq, SimGenerator, scaled_versions
from bench.sim.model import FleetModel
from bench.sim.perf import CONSTANTS, Perf, length_stats, load_params, prompt_lengths, scaled
from topics.errors import ConfigError


def _generator(model: FleetModel) -> SimGenerator:
    generator = SimpleNamespace(max_policy_lag=1, groups_per_step=0.0, quota_window_steps=3, backpressure_stall_s=0.0,
                                quota_counts_zero_variance=False, quota_groups_per_batch=0)
    fleet = SimpleNamespace(speed=model, cfg=SimpleNamespace(generator=generator), max_concurrent=4)
    return SimGenerator("sim0", fleet, seed=0)


def _elapse(gen: SimGenerator, sim_s: float) -> None:
    """Make ``sim_s`` simulated seconds pass for the next ``advance``."""
    gen.last = time.monotonic() - sim_s / gen.m.time_scale
    gen.advance()


async def test_running_sequences_share_the_gpu_and_carry_the_version_of_each_token() -> None:
    model = FleetModel(tokens_per_s=150.0, seq_tokens_per_s=100.0, time_scale=1000.0)
    gen = _generator(model)
    loop = asyncio.get_running_loop()
    a, b = (Seq(length=300, finished=loop.create_future()) for _ in range(2))
    gen.running = [a]
    _elapse(gen, 1.0)  # alone: one sequence's cap, 100 tokens/s
    assert 99 <= a.counted <= 101
    gen.running.append(b)
    _elapse(gen, 1.0)  # two share 150 tokens/s
    assert 173 <= a.counted <= 177 and 74 <= b.counted <= 76
    gen.version = 1  # a swap: what follows is version 1
    gen.paused = 1
    _elapse(gen, 5.0)
    assert 173 <= a.counted <= 177  # nothing decoded while paused
    gen.paused = 0
    _elapse(gen, 10.0)
    assert a.finished.done() and b.finished.done() and not gen.running
    assert [v for v, _ in a.versions] == [0, 1] and sum(n for _, n in a.versions) == 300
    assert sum(n for _, n in b.versions) == 300


def test_a_scaled_episode_keeps_each_versions_share_of_the_response() -> None:
    v = scaled_versions([(3, 600), (4, 200), (5, 200)], 10)
    assert v.tolist() == [3, 3, 3, 3, 3, 3, 4, 4, 5, 5]
    assert scaled_versions([(7, 5)], 1).tolist() == [7]


def test_response_lengths_follow_the_stated_lognormal_with_its_cap() -> None:
    model = FleetModel(length_median=512, length_sigma=0.9, length_cap=4096)
    rng = np.random.default_rng(1)
    lengths = np.array([model.response_length(rng) for _ in range(20_000)])
    assert 480 <= np.median(lengths) <= 545
    assert lengths.max() == 4096 and 0.005 < (lengths == 4096).mean() < 0.02
    assert abs(model.mean_response_length() - lengths.mean()) < 25


def test_the_areal_lengths_match_what_the_paper_s_runs_report() -> None:
    """Mean about 5.7k at an 8k cap, past 7k at 24k, under 5% truncated at 27k (bench/sim/presets/areal-1.5b.yaml)."""
    p = load_params("areal-1.5b.yaml")
    assert 5500 <= length_stats(p, 8192)["mean"] <= 5900
    assert length_stats(p, 24576)["mean"] > 7000
    assert length_stats(p)["truncated"] < 0.05
    drawn = np.concatenate([prompt_lengths(p, i)[1] for i in range(3000)])
    assert abs(drawn.mean() - length_stats(p)["mean"]) < 150 and drawn.max() == 27648
    prompt, lengths = prompt_lengths(p, 17)
    assert (prompt, lengths.tolist()) == (prompt_lengths(p, 17)[0], prompt_lengths(p, 17)[1].tolist())  # same seed
    assert 64 <= prompt <= 1024 and len(lengths) == 16


def test_decode_is_a_roofline_of_bytes_and_flops_plus_the_iteration_overhead() -> None:
    p = load_params("areal-1.5b.yaml")
    perf = Perf(p)
    assert perf.kv_per_token == 2 * 28 * 2 * 128 * 2  # K and V, layers, KV heads, head dim, fp16
    bw = 3.35e12 * CONSTANTS.hbm_efficiency
    # 64 sequences holding 320k tokens: memory-bound, weights plus their KV
    expected = (1.78e9 * 2 + 320_000 * perf.kv_per_token) / bw + CONSTANTS.iteration_overhead_s
    assert float(perf.iteration_s(64, 320_000)) == pytest.approx(expected)
    # a huge batch of short contexts is compute-bound: 2 FLOPs a parameter a sequence
    flops = 989e12 * CONSTANTS.mfu
    big = float(perf.iteration_s(20_000, 20_000))
    assert big == pytest.approx((2 * 1.78e9 * 20_000 + 4 * 28 * 12 * 128 * 20_000) / flops
                                + CONSTANTS.iteration_overhead_s)
    # the KV pool: 80 GB x 0.8 less the fp16 weights, over the bytes a token
    assert perf.kv_capacity == pytest.approx((80e9 * 0.8 - 1.78e9 * 2) / perf.kv_per_token)
    assert perf.weight_load_s == pytest.approx(1.78e9 * 2 / 50e9)


def test_a_training_step_counts_dense_and_attention_flops_and_the_minibatch_all_reduces() -> None:
    p = load_params("areal-7b.yaml")
    perf = Perf(p)
    s = np.array([1000.0, 3000.0])
    attn = 28 * 28 * 128
    flops = (6 + 2) * 7.62e9 * s.sum() + (3 + 1) * 2 * attn * (s * s).sum()
    allreduce = 2 * 47 / 48 * 7.62e9 * 4 / 50e9
    assert perf.train_s(s, 48) == pytest.approx(flops / (48 * 989e12 * CONSTANTS.mfu) + 4 * allreduce)


def test_presets_load_strictly_and_scale_down_together() -> None:
    p = load_params("areal-1.5b.yaml")
    assert (p.gpus, p.async_generation_gpus, p.prompts_per_step, p.staleness) == (128, 96, 512, 8)
    assert p.paper.async_vs_sync == 2.77 and p.overrides.decode_iteration_s == 0  # no speed is set
    s = scaled(p, 16)
    assert (s.gpus, s.async_generation_gpus, s.prompts_per_step, s.samples_per_prompt) == (8, 6, 32, 16)
    assert s.inflight_cap == 32
    with pytest.raises(ConfigError, match="--scale"):
        scaled(p, 3)
    with pytest.raises(ConfigError, match="bogus"):
        load_params("areal-1.5b.yaml", ["bogus=1"])
    with pytest.raises(ConfigError, match="async_generation_gpus"):
        load_params("areal-1.5b.yaml", ["async_generation_gpus=128"])


def test_an_engine_s_batch_time_is_the_sum_of_its_iterations_until_the_last_response() -> None:
    p = load_params("areal-1.5b.yaml")
    perf = Perf(p)
    groups = [(100, np.array([3, 5])), (50, np.array([1]))]
    # by hand: iteration k decodes every response longer than k - 1; its context is the prompts plus k - 1 tokens
    ctx = [(100 + 100 + 50) + 0, (100 + 100) + 2 * 1, (100 + 100) + 2 * 2, 100 + 3, 100 + 4]
    running = [3, 2, 2, 1, 1]
    by_hand = sum(float(perf.iteration_s(b, c)) for b, c in zip(running, ctx))
    prefill = perf.prefill_s(np.array([100])) + perf.prefill_s(np.array([50]))
    assert engine_batch_s(perf, groups) == pytest.approx(by_hand + prefill)


def test_a_sync_step_waits_for_its_longest_response_then_trains_on_every_gpu() -> None:
    p = scaled(load_params("areal-1.5b.yaml"), 16)
    log = simulate_sync(p, 2)
    perf = Perf(p)
    batch = [prompt_lengths(p, k) for k in range(p.prompts_per_step)]
    gen = max(engine_batch_s(perf, batch[e::p.gpus]) for e in range(p.gpus))
    train = perf.train_s(np.concatenate([q + r for q, r in batch]), p.gpus)
    assert log.ends[0] == pytest.approx(gen + train + perf.weight_load_s)
    assert gen > 27648 * float(perf.iteration_s(1, 0))  # the capped responses set the step


def test_the_staleness_bound_opens_the_pipeline() -> None:
    """eta = 0 alternates generation and training on the split; a bound of 1 overlaps them (AReaL Fig. 5c: 2.09x);
    no bound is at least as fast; the trainer is busier with more overlap."""
    p = scaled(load_params("areal-1.5b.yaml", ["response_tokens.cap=8192"]), 16)
    rates = {eta: simulate_async(replace(p, staleness=eta), 8).summary(2) for eta in (0, 1, 4, -1)}
    tps = [rates[e]["tokens_per_s"] for e in (0, 1, 4, -1)]
    assert all(b >= a * 0.99 for a, b in itertools.pairwise(tps))
    assert tps[1] >= 1.8 * tps[0]
    assert rates[0]["staleness_mean"] == 0 and rates[4]["staleness_mean"] > 0
    assert rates[1]["trainer_busy"] > rates[0]["trainer_busy"]
