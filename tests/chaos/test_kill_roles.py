"""Chaos: during a demo-config run, SIGKILL a generator, the buffer and the trainer (each in turn); `up` restarts
each (``up.restart``). Then the audit must show 0 episodes lost and 0 episodes in two trained batches, and training
must have continued from its checkpoint to ``max_steps`` with every ledger step present exactly once.

The buffer and trainer kills take the role's whole process group, as a crashed container would. The generator
kill takes its main process only: its vLLM engine core and worker, re-parented to init, must not outlive it (``up``
reaps the group before the restart), and when ``up`` exits nothing of any role is left. Marked slow; bounded by
the run's own wall-clock budget.
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

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
STEPS = 90


def role_pid(run_dir: Path, role: str) -> int | None:
    out = subprocess.run(["pgrep", "-f", f"streamforge run {role} .*--run.run_dir={run_dir}"], capture_output=True,
                         text=True).stdout.split()
    return int(out[0]) if out else None


def kill_group(pid: int) -> None:
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> set[int]:
    """Live processes (not zombies) of process group ``pgid``, from /proc."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, ...
            out.add(int(stat.parent.name))
    return out


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = {p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)}
        if not alive:
            return set()
        time.sleep(0.2)
    return alive


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.timeout(1200)
def test_killed_roles_restart_and_nothing_is_lost_or_trained_twice(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    up = subprocess.Popen(
        [sys.executable, "-m", "streamforge", "up", "--config", "configs/demo.yaml", "--run-dir", str(run_dir),
         f"--trainer.max_steps={STEPS}", "--trainer.reward_target=0", "--trainer.checkpoint_every=10",
         "--up.restart=true", "--up.max_wall_s=900"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    plan = [(15, "generator"), (35, "buffer"), (55, "trainer")]
    killed: list[tuple[str, int]] = []
    groups: set[int] = set()  # every role's process group seen
    orphans: set[int] = set()
    try:
        deadline = time.monotonic() + 1000
        while plan and time.monotonic() < deadline and up.poll() is None:
            steps = len(read_metrics(run_dir / "metrics.jsonl"))
            if steps >= plan[0][0]:
                _, role = plan.pop(0)
                pid = role_pid(run_dir, role)
                assert pid is not None, f"no {role} process to kill"
                groups.add(os.getpgid(pid))
                if role == "generator":  # the main process alone: its engine processes are left to up
                    orphans = group_members(os.getpgid(pid)) - {pid}
                    assert orphans, "the generator has no engine processes to orphan"
                    os.kill(pid, signal.SIGKILL)
                    assert wait_gone(orphans, 60) == set(), "the killed generator's engine outlived it"
                else:
                    kill_group(pid)
                killed.append((role, steps))
            for role in ("generator", "buffer", "trainer", "feeder"):
                if (pid := role_pid(run_dir, role)) is not None:
                    groups.add(os.getpgid(pid))
            time.sleep(0.5)
        out, _ = up.communicate(timeout=max(60, deadline - time.monotonic()))
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    assert [r for r, _ in killed] == ["generator", "buffer", "trainer"], out[-3000:]
    left = {g: group_members(g) for g in groups}
    assert not any(left.values()), f"processes of the run outlived up: {left}"
    assert up.returncode == 0, out[-4000:]
    assert "restarting it" in out
    ledger = [orjson.loads(line) for line in (run_dir / "trainer" / "ledger.jsonl").read_bytes().splitlines()]
    assert [row["step"] for row in ledger] == list(range(1, STEPS + 1))  # resumed from its checkpoint, no gap
    trained = [b for row in ledger for b in row["batch_ids"]]
    assert len(trained) == len(set(trained))
    audit = orjson.loads((run_dir / "audit.json").read_bytes())
    assert_nothing_lost(audit, reconciles=False)  # no episode and no prompt lost though every role was killed
    assert audit["in_two_batches"] == 0, audit


@pytest.mark.timeout(1200)
def test_nats_outage_of_ten_seconds_hangs_nothing(tmp_path: Path) -> None:
    """NATS frozen (SIGSTOP) for 10 s mid-run: generation goes on with the weights it has until its quota, training
    goes on with the backlog, nothing hangs, and when NATS returns the run catches up, finishes and reconciles."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    up = subprocess.Popen(
        [sys.executable, "-m", "streamforge", "up", "--config", "configs/demo.yaml", "--run-dir", str(run_dir),
         "--trainer.max_steps=60", "--trainer.reward_target=0", "--up.max_wall_s=900"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while len(read_metrics(run_dir / "metrics.jsonl")) < 20 and time.monotonic() < deadline:
            assert up.poll() is None, up.communicate()[0][-3000:]
            time.sleep(0.5)
        nats_pid = int(subprocess.run(["pgrep", "-f", f"nats-server .*{run_dir}"], capture_output=True,
                                      text=True).stdout.split()[0])
        os.kill(nats_pid, signal.SIGSTOP)
        stopped_at = len(read_metrics(run_dir / "metrics.jsonl"))
        time.sleep(10)
        os.kill(nats_pid, signal.SIGCONT)
        out, _ = up.communicate(timeout=max(60, deadline - time.monotonic()))
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    assert up.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) >= 60 > stopped_at
    # while NATS is frozen the trainer trains the bounded backlog (the generator's quota stops it taking prompts
    # it cannot be sure the trainer wants) and cannot announce versions; afterwards everyone catches up, and no
    # batch trained was staler than the bound (the trainer drops one that would be)
    assert max(r["staleness_max"] for r in rows) <= 4  # staleness.max_versions holds through the outage
    audit = orjson.loads((run_dir / "audit.json").read_bytes())
    assert_nothing_lost(audit, reconciles=False)
