"""The product a user meets first: `streamforge up` on the demo config, bounded, through every role.

Checks the run-directory contract (metrics.jsonl, traces.jsonl, reward.png, checkpoints, the final HF model,
audit.json), that the reward rises, that one episode's trace goes from generation through the buffer's batch and
the trainer's step to a generator's swap, and that the audit reconciles.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from helpers.audits import assert_nothing_lost
from runtime.telemetry import read_spans
from streamforge.plots import read_metrics
from streamforge.traceview import episode_spans

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 120


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "streamforge", "up", "--config", "configs/demo.yaml", "--run-dir", str(run_dir),
         f"--trainer.max_steps={STEPS}", "--trainer.checkpoint_every=40",
         "--trainer.reward_target=0", "--up.max_wall_s=600"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    return run_dir, proc


@pytest.mark.timeout(960)
def test_up_runs_learns_and_leaves_the_run_directory(demo_run) -> None:
    run_dir, proc = demo_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) >= STEPS
    for key in ("step", "policy_version", "time_s", "reward_mean", "loss", "staleness_mean", "episodes"):
        assert all(key in r for r in rows), key
    first = sum(r["reward_mean"] for r in rows[:20]) / 20
    last = sum(r["reward_mean"] for r in rows[-20:]) / 20
    assert last > first, (first, last)
    assert (run_dir / "reward.png").stat().st_size > 0
    assert any((run_dir / "checkpoints").iterdir())
    assert (run_dir / "hf" / "config.json").exists()
    audit = orjson.loads((run_dir / "audit.json").read_bytes())
    assert_nothing_lost(audit, reconciles=False)
    assert audit["produced"] >= audit["trained"] > 0


@pytest.mark.timeout(120)
def test_one_episode_can_be_followed_end_to_end(demo_run) -> None:
    run_dir, _ = demo_run
    spans = read_spans(run_dir / "traces.jsonl")
    ledger = [orjson.loads(line) for line in (run_dir / "trainer" / "ledger.jsonl").read_bytes().splitlines()]
    batch_spans = [s for s in spans if s["name"] == "buffer.batch"
                   and s["attributes"].get("buffer.batch_id") in {b for row in ledger[:5] for b in row["batch_ids"]}]
    assert batch_spans, "no span for the first trained batches"
    linked = {link["span_id"] for link in batch_spans[0]["links"]}
    produce = next(s for s in spans if s["span_id"] in linked)
    episode_id = produce["attributes"]["episode_id"]
    names = {s["name"] for s in episode_spans(spans, episode_id)}
    for expected in ("generator.generate", "generator.reward", "generator.produce", "buffer.batch", "trainer.step",
                     "trainer.publish"):
        assert expected in names, (expected, names)
    assert any("swap" in n for n in names), names
    out = subprocess.run([sys.executable, "-m", "streamforge", "trace", "--run-dir", str(run_dir), episode_id],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "trainer.step [trainer]" in out.stdout, out.stdout + out.stderr
