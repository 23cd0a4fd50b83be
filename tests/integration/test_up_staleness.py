"""The staleness bound through a whole run with a slow trainer and a fast generator: ``up`` on the demo config
whose trainer sleeps 0.4 s a step (``helpers.losses:slow_grpo``). No trained batch is staler than
``staleness.max_versions``, and the generator is throttled instead of producing what the buffer must drop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from helpers.audits import assert_nothing_lost
from streamforge.plots import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40


@pytest.mark.timeout(900)
def test_a_slow_trainer_trains_nothing_staler_than_the_bound(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT / "tests"))
    proc = subprocess.run(
        [sys.executable, "-m", "streamforge", "up", "--config", "configs/demo.yaml", "--run-dir", str(run_dir),
         f"--trainer.max_steps={STEPS}", "--trainer.reward_target=0", "--trainer.checkpoint_every=100",
         "--trainer.loss=helpers.losses:slow_grpo", '--trainer.loss_args={"delay_s": 0.4}', "--up.max_wall_s=600",
         "--up.lag_every_s=0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == STEPS
    assert max(r["staleness_max"] for r in rows) <= 4  # staleness.max_versions of the demo
    audit = orjson.loads((run_dir / "audit.json").read_bytes())
    assert_nothing_lost(audit)
    # throttled, not wasted: the buffer dropped (almost) nothing as stale, the trainer refused nothing as stale
    assert audit["stale_fraction"] <= 0.05, audit
    assert rows[-1]["stale_batches"] == audit["stale_batches"]
