"""`streamforge up` on the agentic configs (configs/blackjack.yaml, configs/calculator.yaml), bounded, through every
role and the env replicas up starts (up.envs: 2).

* blackjack: the reward rises above the random policy's (-0.392 a hand over 100,000 hands, ``python -m
  envs.builtin_blackjack``; the warm-started policy starts below it, about -0.7, because its invalid actions lose
  the hand);
* calculator: the reward rises above the warm-started policy's own first steps as it calls the tool more (the
  policy that never calls the tool scores about 0: the tiny model cannot multiply two-digit numbers in its head),
  while one env replica is SIGKILLed mid-run: up restarts it (``up.restart``), the episodes it held restart on the
  other replica (``env/restarts``), and the run finishes;
* both: every metrics row carries the env counters and the audit reconciles (nothing lost, nothing trained twice).

Each run is bounded by a reward target between the start and the config's own target, and by max_steps and a wall
budget; about 3 minutes each on the shared 2-core machine under load (measured 168 s and 189 s). The calculator run
samples at temperature 1.0, not the config's 0.7: its first steps then score lower (about 0.36 rather than 0.5), so
a rise from them shows within the test's bound; that the config reaches its own target is a bench/RESULTS.md run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from helpers.audits import assert_nothing_lost
from streamforge.plots import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ENV_KEYS = ("env/turns_mean", "env/restarts", "env/tool_calls_mean")
BLACKJACK_RANDOM = -0.392  # the random policy's mean reward a hand (envs/builtin_blackjack.py, 100,000 hands)
WINDOW = 20  # trainer.reward_window of both configs


def start_up(config: str, run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "streamforge", "up", "--config", config, "--run-dir", str(run_dir),
         "--trainer.checkpoint_every=1000", "--up.drain_timeout_s=10", "--up.live=lines", *overrides],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def finish(proc: subprocess.Popen, timeout_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # up stops its roles and brokers
        out, _ = proc.communicate(timeout=60)
    return out


def role_pid(run_dir: Path, marker: str) -> int | None:
    """The pid of the role process of this run whose command line holds ``marker`` (up starts each role as
    ``streamforge run <role> ... --run.run_dir=<run_dir> ...``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"--run.run_dir={run_dir}".encode() in argv and marker.encode() in argv and b"run" in argv:
            return int(entry.name)
    return None


def window_mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def check_run(run_dir: Path, rc: int, out: str) -> list[dict]:
    assert rc == 0, out[-4000:]
    assert "trainer finished" in out, out[-2000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) >= 2 * WINDOW, len(rows)
    for key in ENV_KEYS:
        assert all(key in r for r in rows), key
    audit = orjson.loads((run_dir / "audit.json").read_bytes())
    assert_nothing_lost(audit)
    assert audit["in_two_batches"] == 0 and audit["produced"] >= audit["trained"] > 0, audit
    assert audit["trained_steps"] == len(rows), (audit["trained_steps"], len(rows))
    return rows


@pytest.mark.timeout(420)
def test_up_blackjack_beats_the_random_policy(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_up("configs/blackjack.yaml", run_dir, "--trainer.max_steps=200", "--trainer.reward_target=-0.3",
                    "--up.max_wall_s=300")
    out = finish(proc, 360)
    rows = check_run(run_dir, proc.returncode, out)
    last = window_mean(rows[-WINDOW:], "reward_mean")
    assert last > BLACKJACK_RANDOM, (last, [r["reward_mean"] for r in rows])
    assert window_mean(rows[:WINDOW], "reward_mean") < last
    assert all(r["env/turns_mean"] >= 1 and r["env/tool_calls_mean"] == 0 for r in rows)


@pytest.mark.timeout(480)
def test_up_calculator_learns_the_tool_through_a_killed_replica(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_up("configs/calculator.yaml", run_dir, "--trainer.max_steps=250", "--trainer.reward_target=0.55",
                    "--generator.temperature=1.0", "--up.restart=true", "--up.max_wall_s=360")
    metrics = run_dir / "metrics.jsonl"
    kills: list[int] = []
    kill_step = 0
    deadline = time.monotonic() + 300
    # Kill env-0 once training is under way. A kill at a moment when env-0 holds no open session restarts no
    # episode (env/restarts stays 0: seen once in a full make test), so while env/restarts stays 0 for 10 steps after
    # a kill, kill env-0 again once up has restarted it (at most 3 kills).
    while proc.poll() is None and time.monotonic() < deadline and len(kills) < 3:
        rows = read_metrics(metrics)
        if rows and rows[-1].get("env/restarts", 0) > 0:
            break
        if len(rows) >= (10 if not kills else kill_step + 10):
            pid = role_pid(run_dir, "--env.replica_id=calculator-0")
            if pid is not None and pid not in kills:  # None or the killed pid: up is restarting it
                os.kill(pid, signal.SIGKILL)
                kills.append(pid)
                kill_step = len(rows)
        time.sleep(0.5)
    out = finish(proc, 420)
    assert kills, out[-4000:]
    rows = check_run(run_dir, proc.returncode, out)
    assert "env-0 exited with code -9; restarting it" in out, out[-4000:]
    assert rows[-1]["env/restarts"] > 0, rows[-1]  # the killed replica's open episodes restarted on the other
    first, last = window_mean(rows[:WINDOW], "reward_mean"), window_mean(rows[-WINDOW:], "reward_mean")
    assert last >= first + 0.1, (first, last)
    assert window_mean(rows[-WINDOW:], "env/tool_calls_mean") > window_mean(rows[:WINDOW], "env/tool_calls_mean")
    assert all(r["env/turns_mean"] >= 1 for r in rows)
