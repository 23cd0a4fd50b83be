"""bench/scale.py's simulated GPU: continuous batching shares a generator's rate, a swap changes the version of the
tokens that follow it, and the stated length distribution holds its median and cap."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np

from bench.sim.generators import Seq, SimGenerator
from bench.sim.model import FleetModel


def _generator(model: FleetModel) -> SimGenerator:
    generator = SimpleNamespace(max_policy_lag=1, groups_per_step=0.0, quota_window_steps=3, backpressure_stall_s=0.0,
                                quota_counts_zero_variance=False, quota_groups_per_batch=0)
    return SimGenerator("sim0", SimpleNamespace(model=model, cfg=SimpleNamespace(generator=generator)), seed=0)


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
    gen.paused = True
    _elapse(gen, 5.0)
    assert 173 <= a.counted <= 177  # nothing decoded while paused
    gen.paused = False
    _elapse(gen, 10.0)
    assert a.finished.done() and b.finished.done() and not gen.running
    assert [v for v, _ in a.versions] == [0, 1] and sum(n for _, n in a.versions) == 300
    assert sum(n for _, n in b.versions) == 300


def test_response_lengths_follow_the_stated_lognormal_with_its_cap() -> None:
    model = FleetModel(length_median=512, length_sigma=0.9, length_cap=4096)
    rng = np.random.default_rng(1)
    lengths = np.array([model.response_length(rng) for _ in range(20_000)])
    assert 480 <= np.median(lengths) <= 545
    assert lengths.max() == 4096 and 0.005 < (lengths == 4096).mean() < 0.02
    assert abs(model.mean_response_length() - lengths.mean()) < 25
