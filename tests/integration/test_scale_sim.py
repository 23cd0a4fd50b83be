"""bench/scale.py's simulated fleet at a small size, against real brokers, a real buffer process and the audit.

Four simulated generators in two processes, a simulated trainer, 8 groups per batch, 20 simulated seconds per real
second; one synchronous and one asynchronous run. The accounting must close: every produced episode is batched,
dropped or still pending (nothing lost, nothing in two batches or trained twice), the trainer published a version
per step it trained, and no trained token is staler than the mode's ``staleness.max_versions``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.sim.fleet import STALENESS, FleetRun, run_fleet
from bench.sim.model import FleetModel

pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_simulated_fleet_accounts_for_every_episode(mode: str, tmp_path: Path) -> None:
    run = FleetRun(generators=4, mode=mode, model=FleetModel(time_scale=20.0), processes=2, groups_per_batch=8,
                   warmup_s=2.0, measure_s=6.0)
    out = await run_fleet(run, tmp_path)
    audit = out["audit"]
    assert not out["failures"], out["failures"]
    assert out["steps"] >= 2, out  # the trainer trained real batches
    assert audit["reconciles"], audit
    dropped = sum(n for reason, n in audit["dropped"].items() if reason not in ("duplicate", "malformed"))
    assert audit["produced"] == audit["batched"] + dropped + audit["pending"] > 0
    assert audit["produced"] == out["generator"]["episodes"]  # every episode the generators made reached Kafka
    assert audit["lost"] == audit["in_two_batches"] == audit["trained_twice"] == audit["batched_and_dropped"] == 0
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
