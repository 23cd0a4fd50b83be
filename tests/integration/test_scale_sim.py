"""bench/scale.py's simulated fleet at a small size, against real brokers, a real feeder, a real buffer process and
the audit.

Per-generator mode: four simulated generators in two processes, a simulated trainer, 8 groups per batch, 20
simulated seconds per real second; one synchronous and one asynchronous run. The accounting must close: every
produced episode is batched, dropped or still pending (nothing lost, nothing in two batches or trained twice), every
group came from a prompt the feeder put on the ``prompts`` topic and the generators' group committed, the trainer
published a version per step it trained, and no trained token is staler than the mode's ``staleness.max_versions``.

Preset mode: the AReaL 1.5B preset scaled down 32 times (4 GPUs, 16 prompts of 16 a step, responses capped at 4k
to keep it short) through the same pipeline: its step time follows the pure model's prediction for the same
preset, and the audit closes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.sim.fleet import STALENESS, FleetRun, run_fleet
from bench.sim.fleetsim import simulate_async, simulate_sync
from bench.sim.model import FleetModel
from bench.sim.perf import load_params, scaled

pytestmark = [pytest.mark.integration]


def _closes(out: dict) -> dict:
    audit = out["audit"]
    assert not out["failures"], out["failures"]
    assert audit["reconciles"], audit
    dropped = sum(n for reason, n in audit["dropped"].items() if reason not in ("duplicate", "malformed"))
    assert audit["produced"] == audit["batched"] + dropped + audit["pending"] > 0
    # every episode the generators made reached Kafka; a prompt handed out again after the group rebalanced (the
    # second process joining) is generated twice, with the same ids: a duplicate record
    assert audit["produced"] + audit["duplicate_records"] == out["generator"]["episodes"]
    assert audit["lost"] == audit["in_two_batches"] == audit["trained_twice"] == audit["batched_and_dropped"] == 0
    gen = out["generator"]
    # every group answered a prompt taken from the topic; none was undecodable
    assert gen["prompts_consumed"] >= gen["groups"] > 0 and gen["prompts_dead_lettered"] == 0
    assert gen["prompts_commits"] >= 1
    assert set(out["gaps"]) >= {"offset_gaps"}  # the buffer's gap counters are read
    return audit


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_simulated_fleet_accounts_for_every_episode(mode: str, tmp_path: Path) -> None:
    run = FleetRun(generators=4, mode=mode, model=FleetModel(time_scale=20.0), processes=2, groups_per_batch=8,
                   warmup_s=2.0, measure_s=6.0)
    out = await run_fleet(run, tmp_path)
    audit = _closes(out)
    assert out["steps"] >= 2, out  # the trainer trained real batches
    assert audit["trained_steps"] == out["steps"]  # the ledger has a line per simulated step
    # a zero-variance group is dropped as such, unless it was stale first
    assert 0 < audit["dropped"].get("zero_variance", 0) <= out["generator"]["zero_variance"] * 4
    # one version per step (sync waits for each round; async folds the steps of a busy round into the next)
    assert 1 <= out["versions_published"] <= out["steps"] + 1
    if mode == "sync":
        assert out["versions_published"] == out["steps"]
    assert out["generator"]["versions_seen"] >= out["versions_published"] - 1
    assert out["staleness_max"] <= STALENESS[mode]
    assert out["stale_batches"] == audit["stale_batches"] == 0
    assert 0 < out["trainer_busy"] <= 1


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_scaled_preset_runs_at_the_pure_model_s_pace(mode: str, tmp_path: Path) -> None:
    params = scaled(load_params("areal-1.5b.yaml", ["response_tokens.cap=4096"]), 32)
    run = FleetRun(generators=0, mode=mode, params=params, steps=5, time_scale=25.0, token_scale=16, processes=1,
                   measure_s=240)
    out = await run_fleet(run, tmp_path)
    audit = _closes(out)
    assert audit["trained_steps"] == out["steps"] >= 5
    assert audit["dropped"].get("zero_variance", 0) == 0  # AReaL trains every group
    assert out["engines"] == (4 if mode == "sync" else 3)
    assert out["staleness_max"] <= (0 if mode == "sync" else params.staleness)
    model = (simulate_sync(params, 5).summary(1) if mode == "sync" else simulate_async(params, 6).summary(2))
    assert out["s_per_step"] == pytest.approx(model["s_per_step"], rel=0.3), (out["step_intervals_s"], model)
