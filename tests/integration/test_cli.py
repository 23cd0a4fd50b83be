"""The CLI as a user runs it: `streamforge brokers` as a subprocess, then topics/tail/status against it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamforge", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def test_help_lists_every_command() -> None:
    out = cli("--help").stdout
    for command in ("brokers", "run", "up", "topics", "tail", "status", "audit", "trace"):
        assert command in out


def test_run_unknown_role_and_bad_config_fail_clearly() -> None:
    res = cli("run", "painter")
    assert res.returncode != 0 and "unknown role 'painter'" in res.stderr
    res = cli("run", "buffer", "--buffer.no_such_key=1")
    assert res.returncode != 0 and "buffer.no_such_key" in res.stderr


def test_brokers_command_serves_until_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "streamforge", "brokers", "--data-dir", str(tmp_path / "b")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        lines = {}
        deadline = time.monotonic() + 60
        while len(lines) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            key, _, value = line.strip().partition("=")
            if key in ("KAFKA_BOOTSTRAP", "NATS_URL"):
                lines[key] = value
        assert set(lines) == {"KAFKA_BOOTSTRAP", "NATS_URL"}, proc.stderr.read()
        env = {"STREAMFORGE_KAFKA_BOOTSTRAP": lines["KAFKA_BOOTSTRAP"], "STREAMFORGE_NATS_URL": lines["NATS_URL"],
               "STREAMFORGE_RUN__PREFIX": "cli"}
        created = cli("topics", "create", env=env)
        assert created.returncode == 0, created.stderr
        assert "cli.episodes\tcreated" in created.stdout
        again = cli("topics", "create", env=env)
        assert "cli.episodes\texists" in again.stdout
        described = orjson.loads(cli("topics", "describe", env=env).stdout)
        assert described["cli.prompts"]["partitions"] == 4 and described["cli.prompts"]["records"] == 0
        assert isinstance(described["cli.prompts"]["configs"], dict)  # retention.ms etc. where the config sets them
        status = cli("status", "--interval", "0.2", env=env)
        assert status.returncode == 0, status.stderr
        assert orjson.loads(status.stdout)["policy"]["latest_version"] is None
        tail = cli("tail", "episodes", env=env)
        assert tail.returncode == 0 and tail.stdout == ""
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        assert len(children.stdout.split()) >= 2  # the brokers run as children
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    alive = subprocess.run(["pgrep", "-f", str(tmp_path / "b")], capture_output=True, text=True).stdout.split()
    assert alive == [], "broker children outlived `streamforge brokers`"


def test_tail_prints_decoded_messages_and_errors(run_config) -> None:
    import asyncio

    import numpy as np

    from topics.kafka import Producer
    from topics.schemas import Prompt

    async def produce() -> None:
        async with Producer(run_config.kafka) as p:
            await p.send(run_config.names.prompts, Prompt(prompt_id="p1", task="addmod10", text="1+2=",
                                                           token_ids=np.arange(20, dtype=np.int32)), key="p1")
            await p.send_raw(run_config.names.prompts, b"junk", key="p2")

    asyncio.run(produce())
    env = {"STREAMFORGE_KAFKA_BOOTSTRAP": run_config.kafka.bootstrap, "STREAMFORGE_NATS_URL": run_config.nats.url,
           "STREAMFORGE_RUN__PREFIX": run_config.run.prefix}
    res = cli("tail", "prompts", env=env)
    rows = [orjson.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 2
    good = next(r for r in rows if "message" in r)
    assert good["message"]["prompt_id"] == "p1" and good["message"]["token_ids"]["shape"] == [20]
    bad = next(r for r in rows if "error" in r)
    assert bad["error"]["reason"] == "malformed"


def test_up_second_signal_kills_at_once_and_leaves_no_broker(tmp_path: Path) -> None:
    """Two Ctrl-C's: `up` exits 130 at once, and its embedded brokers (own sessions) do not outlive it."""
    proc = subprocess.Popen([sys.executable, "-m", "streamforge", "up", "--config", str(ROOT / "configs/demo.yaml"),
                             "--run-dir", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, start_new_session=True)

    def brokers() -> list[str]:  # tansu by its listener address, nats-server by its store under the run dir
        return [pid for pattern in (f"tcp://{seen['KAFKA_BOOTSTRAP']} ", str(tmp_path / "run" / "brokers"))
                for pid in subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()]

    seen: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 90
        while "RUN_DIR" not in seen and time.monotonic() < deadline:  # printed once the brokers are up
            line = proc.stdout.readline()
            if not line:
                break
            key, _, value = line.strip().partition("=")
            seen[key] = value
        assert "KAFKA_BOOTSTRAP" in seen and "RUN_DIR" in seen, seen
        assert len(brokers()) == 2, brokers()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while brokers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert brokers() == [], "broker children outlived a forced `streamforge up`"
