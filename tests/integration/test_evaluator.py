"""The evaluator joins a demo run already in progress (`streamforge up`, real brokers, vLLM CPU engines) and
reports versions it did not see start, on the held-out split, without ever being a weight-sync member."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from producers.evaluator import read_eval_rows
from producers.sources import eval_prompts
from streamforge.plots import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def wait_for(what: str, check, timeout_s: float, procs: list[subprocess.Popen]):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        for p in procs:
            assert p.poll() is None, f"{p.args[:5]} exited with {p.returncode} while waiting for {what}"
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


@pytest.mark.timeout(660)
def test_a_late_evaluator_reports_versions_it_did_not_see_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    up_log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "streamforge", "up", "--config", "configs/demo.yaml", "--run-dir", str(run_dir),
         "--trainer.max_steps=5000", "--trainer.reward_target=0", "--trainer.checkpoint_every=3",
         "--up.max_wall_s=540", "--up.live=lines", "--up.lag_every_s=0"],
        cwd=ROOT, env=env, stdout=up_log, stderr=subprocess.STDOUT, start_new_session=True)
    evaluator: subprocess.Popen | None = None
    try:
        def endpoints() -> dict[str, str]:
            lines = (tmp_path / "up.log").read_text(errors="replace").splitlines()
            found = dict(line.split("=", 1) for line in lines if line.startswith(("KAFKA_BOOTSTRAP=", "NATS_URL=")))
            return found if len(found) == 2 else {}

        addr = wait_for("the brokers", endpoints, 120, [up])
        # the run is in progress: the trainer has published a few versions (and checkpointed some)
        wait_for("version 3", lambda: any(r.get("policy_version", 0) >= 3
                                           for r in read_metrics(run_dir / "metrics.jsonl")), 240, [up])
        start_version = max(r["policy_version"] for r in read_metrics(run_dir / "metrics.jsonl"))
        evaluator = subprocess.Popen(
            [sys.executable, "-m", "streamforge", "run", "evaluator", "--config", "configs/demo.yaml",
             f"--run.run_dir={run_dir}", f"--kafka.bootstrap={addr['KAFKA_BOOTSTRAP']}",
             f"--nats.url={addr['NATS_URL']}", f"--model.path={run_dir / 'model'}", "--eval.samples=4",
             "--eval.every_versions=2"],
            # its own core, as `up` gives it (cpu_binds): vLLM's CPU engines would otherwise share core 0, where the
            # generator's spinning OpenMP threads starve the evaluator's start-up for minutes
            cwd=ROOT, env={**env, "VLLM_CPU_OMP_THREADS_BIND": "1"}, stdout=(tmp_path / "evaluator.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True)
        def newer() -> list:  # type: ignore[type-arg]
            return [r for r in read_eval_rows(run_dir / "eval.jsonl") if r["policy_version"] > start_version]

        wait_for("two evaluations of versions newer than the evaluator's start", lambda: len(newer()) >= 2, 300,
                 [up, evaluator])
        assert stop(evaluator) == 0, (tmp_path / "evaluator.log").read_text()[-3000:]
    finally:
        if evaluator is not None:
            stop(evaluator)
        stop(up, 90)
        up_log.close()
    rows = read_eval_rows(run_dir / "eval.jsonl")  # with the drain's final evaluation
    log = (tmp_path / "evaluator.log").read_text(errors="replace")
    size = len(eval_prompts("toy:addmod10", size=64, seed=1))
    assert size == 13
    for r in rows:
        for key in ("policy_version", "step", "time_s", "eval/reward_mean", "eval/accuracy", "eval/pass_at_k",
                    "episodes"):
            assert key in r, (key, r)
        assert r["episodes"] == size and r["k"] == 4
        assert 0.0 <= r["eval/accuracy"] <= 1.0 and 0.0 <= r["eval/pass_at_k"] <= 1.0
        assert r["eval/pass_at_k"] >= r["eval/pass_at_1"] - 1e-9  # pass@4 is at least pass@1
        assert r["step"] > 0  # a late joiner never evaluates the initial weights
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(set(versions)), versions  # each version once, in order
    assert sum(v > start_version for v in versions) >= 2, (start_version, versions)
    assert all(b - a >= 2 for a, b in itertools.pairwise(versions[:-1])), versions  # every_versions (the last: drain)
    # never a weight-sync member: the trainer's rounds target and wait for the generator only
    rounds = [orjson.loads(line) for line in (run_dir / "weightsync" / "versions.jsonl").read_bytes().splitlines()]
    assert rounds and all(set(r["targets"]) <= {"generator-0"} for r in rounds), rounds[-1]
    assert "evaluator" not in (run_dir / "weightsync" / "versions.jsonl").read_text()
    print(f"joined at version {start_version}; evaluated {versions}; skipped {rows[-1]['skipped']}; "
          f"accuracy {[r['eval/accuracy'] for r in rows]}; eval_s {[r['eval_s'] for r in rows]}")
    assert "Traceback" not in log, log[-3000:]
