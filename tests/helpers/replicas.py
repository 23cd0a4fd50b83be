"""Service replicas as real processes for the tests: ``streamforge run env`` and ``streamforge run reward``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# the worktree's code first, then tests/ (the replicas import helpers.countenv, helpers.rewards)
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
FAST_BEATS = ["--env.heartbeat_s=0.5", "--env.health_timeout_s=1.5"]


def common_args(cfg: Any) -> list[str]:
    """The run's identity and brokers, for a replica of the run ``cfg``."""
    return [f"--run.prefix={cfg.run.prefix}", f"--run.run_dir={cfg.run.run_dir}", f"--nats.url={cfg.nats.url}",
            f"--kafka.bootstrap={cfg.kafka.bootstrap}", "--telemetry.metrics=[]", "--telemetry.traces=none"]


def start_role(role: str, cfg: Any, log_path: Path, *args: str) -> subprocess.Popen:
    """``streamforge run <role>`` for the run ``cfg``, its output in ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "streamforge", "run", role, *common_args(cfg), *args],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=ENV, cwd=ROOT)


def start_env_replica(cfg: Any, replica_id: str, log_path: Path, *args: str) -> subprocess.Popen:
    """A replica of the test environment ``count`` (``helpers.countenv:CountEnv``) that logs every session message."""
    return start_role("env", cfg, log_path, "--env.name=count", "--env.impl=helpers.countenv:CountEnv",
                      f"--env.replica_id={replica_id}", "--env.capacity=16", "--env.session_log=true", *FAST_BEATS,
                      *args)


def stop(procs: list[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """SIGTERM each (a graceful drain), SIGKILL what is left after ``timeout_s``; resumes a stopped one first."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
