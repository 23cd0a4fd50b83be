"""Nothing outlives a killed run: a pytest run killed while its session brokers run takes them with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOLDER = ROOT / "tests" / "helpers" / "hold_brokers.py"


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_closed(ports: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        still = [p for p in ports if port_open(p)]
        if not still:
            return []
        time.sleep(0.1)
    return still


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_pytest_takes_its_fixture_brokers_with_it(sig: int, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("STREAMFORGE_KAFKA_BOOTSTRAP", "STREAMFORGE_NATS_URL")}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", str(HOLDER), "-s", "-q", "-p", "no:cacheprovider",
                             f"--basetemp={tmp_path / 'inner'}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    ports: list[int] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        for line in proc.stdout:
            if line.startswith("BROKERS "):
                ports = [int(p) for p in line.split()[1:]]
                break
            assert time.monotonic() < deadline, "the inner run never started its brokers"
        assert ports and all(port_open(p) for p in ports)
        proc.send_signal(sig)
        proc.wait(30)
        assert wait_closed(ports, 10) == [], f"ports {ports} still open after the run was killed with {sig!r}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
