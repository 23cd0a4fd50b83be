"""A generator's vLLM processes forked instead of spawned (producers/vllm_fork.py), against a real vLLM CPU engine.

Each engine starts in a process of its own (tests/helpers/fork_engine.py), as ``streamforge run generator`` does:
forking from this test process, where torch may have run an OpenMP team, is exactly what ``auto`` refuses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from models.tiny_model import build_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def start(model_dir: Path, method: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    proc = subprocess.run([sys.executable, "-m", "helpers.fork_engine", str(model_dir), method], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return orjson.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{\"procs\"")))


def test_owned_generator_forks_places_the_worker_and_samples_as_spawned(tmp_path: Path):
    """Owned: the engine core and its worker are forked (no fresh interpreter), the worker sits on the cores
    vLLM chose for it as a spawned one does, our engine-core plugin came along (the swap took one call), and the
    same seed samples the same tokens as the spawned engine."""
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    forked, spawned = start(model_dir, "owned"), start(model_dir, "spawn")
    forked_procs = {p["comm"]: p for p in forked["procs"] if p["comm"].startswith("VLLM::")}
    spawned_procs = {p["comm"]: p for p in spawned["procs"] if p["comm"].startswith("VLLM::")}
    assert len(forked_procs) == len(spawned_procs) == 2, (forked["procs"], spawned["procs"])
    assert not any(p["spawned"] for p in forked_procs.values())
    assert all(p["spawned"] for p in spawned_procs.values())
    worker = next(c for c in forked_procs if "Worker" in c)
    assert forked_procs[worker]["cores"] == spawned_procs[worker]["cores"]
    if len(os.sched_getaffinity(0)) > 1:  # vLLM keeps a core for the engine core: the worker has fewer
        assert len(forked_procs[worker]["cores"]) < len(os.sched_getaffinity(0))
    assert forked["fused"] and spawned["fused"] and forked["version"] == spawned["version"] == 1
    assert forked["tokens"] == spawned["tokens"] and all(forked["tokens"])
