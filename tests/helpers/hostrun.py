"""A demo run spread over test hosts (``tests/helpers/netns.py``): brokers, feeder and buffer on ``brokers``, the
trainer on ``trainer``, the generator on ``generator``; each role is ``python -m streamforge run ROLE`` started
inside its host's namespace with the settings a multi-host deployment needs (``deploy/README.md``):

* ``kafka.bootstrap``: Tansu's listener on the brokers host's address, advertised as that address;
* ``nats.url``: nats-server on a second address of the brokers host (a peer can lose NATS alone by a route);
* ``weightsync.host``: the trainer host's address (its rendezvous store and gloo sockets);
  ``weightsync.generator_host``: the generator host's address (its gloo sockets).

The test process runs nothing of the run itself: it reads the run directory (shared disk) and runs ``streamforge
audit`` inside the brokers host.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from streamforge.plots import read_metrics
from tests.helpers.netns import Hosts

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("brokers", "trainer", "generator")
KAFKA_PORT, NATS_PORT = 9092, 4222
NATS_OCTET = 11  # the brokers host's second address, for NATS


class HostRun:
    def __init__(self, hosts: Hosts, run_dir: Path, overrides: list[str] = ()) -> None:  # type: ignore[assignment]
        self.hosts = hosts
        self.run_dir = run_dir
        self.nats_ip = hosts.add_address("brokers", NATS_OCTET)
        self.kafka = f"{hosts.addr['brokers']}:{KAFKA_PORT}"
        self.nats_url = f"nats://{self.nats_ip}:{NATS_PORT}"
        self.overrides = [
            f"--run.run_dir={run_dir}", "--run.prefix=hosts", f"--model.path={run_dir / 'model'}",
            f"--kafka.bootstrap={self.kafka}", f"--nats.url={self.nats_url}",
            f"--weightsync.host={hosts.addr['trainer']}", f"--weightsync.generator_host={hosts.addr['generator']}",
            "--trainer.reward_target=0", "--trainer.max_steps=100000", "--trainer.checkpoint_every=5",
            "--generator.metrics_every_s=1", *overrides]
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.env["PYTHONPATH"] = str(ROOT)

    # -- starting ---------------------------------------------------------------------------------
    def _log(self, name: str):
        path = self.run_dir / "logs" / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "ab")

    def start_brokers(self, timeout_s: float = 60.0) -> None:
        with self._log("brokers") as out:
            proc = self.hosts.popen("brokers", [
                sys.executable, str(ROOT / "tests/helpers/netns_brokers.py"), str(self.run_dir / "brokers"),
                self.hosts.addr["brokers"], str(KAFKA_PORT), self.nats_ip, str(NATS_PORT)],
                stdout=subprocess.PIPE, stderr=out, env=self.env, cwd=ROOT)
        self.procs["brokers"] = proc
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline and proc.poll() is None and "READY" not in line:
            line = proc.stdout.readline().decode()
        assert "READY" in line, f"brokers did not start: {self.log_tail('brokers')}"

    def build_model(self) -> None:
        """The demo's tiny model, warm-started as ``up`` does it (``streamforge/up.py``)."""
        code = ("import sys; from models.tiny_model import build_tiny_model; from models.warmstart import warm_start;"
                "p = build_tiny_model(sys.argv[1], seed=0); warm_start(p, 'addmod10', seed=0, target_accuracy=0.3)")
        subprocess.run([sys.executable, "-c", code, str(self.run_dir / "model")], check=True, cwd=ROOT, env=self.env,
                       capture_output=True, timeout=300)

    def cli(self, host: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """``streamforge ARGS --config configs/demo.yaml <the run's overrides>`` inside ``host``."""
        return self.hosts.run(host, [sys.executable, "-m", "streamforge", *args, "--config", "configs/demo.yaml",
                                     *self.overrides], timeout=timeout, cwd=ROOT, env=self.env)

    def create_topics(self) -> None:
        out = self.cli("brokers", "topics", "create")
        assert out.returncode == 0, out.stderr[-2000:]

    def start(self, name: str, role: str, host: str, extra: list[str] = ()) -> subprocess.Popen:  # type: ignore[assignment]
        with self._log(name) as out:
            proc = self.hosts.popen(host, [sys.executable, "-m", "streamforge", "run", role, "--config",
                                           "configs/demo.yaml", *self.overrides, *extra],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                    cwd=ROOT)
        self.procs[name] = proc
        return proc

    def start_roles(self) -> None:
        self.start("feeder", "feeder", "brokers")
        self.start("buffer", "buffer", "brokers", ["--buffer.buffer_id=buffer-0"])
        self.start("trainer", "trainer", "trainer")
        self.start("generator", "generator", "generator", ["--generator.generator_id=generator-0"])

    def stop(self) -> None:
        """SIGKILL every process of the run (its hosts' namespaces are deleted next: nothing is drained)."""
        for host in HOSTS:
            self.hosts.kill(host)
        for proc in self.procs.values():
            proc.wait(10)

    # -- reading the run --------------------------------------------------------------------------
    def log_tail(self, name: str, n: int = 30) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(lines[-n:])

    def log_text(self, name: str) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def steps(self) -> list[dict[str, Any]]:
        """The trainer's per-step rows (``metrics.jsonl``)."""
        return read_metrics(self.run_dir / "metrics.jsonl")

    def step(self) -> int:
        rows = self.steps()
        return rows[-1]["step"] if rows else 0

    def version(self) -> int:
        rows = self.steps()
        return rows[-1]["policy_version"] if rows else -1

    def generator_rows(self) -> list[dict[str, Any]]:
        return read_metrics(self.run_dir / "metrics-generator-0.jsonl")

    def generator_version(self) -> float:
        rows = [r for r in self.generator_rows() if "generator/policy_version" in r]
        return rows[-1]["generator/policy_version"] if rows else -1

    def generator_episodes(self) -> float:
        rows = [r for r in self.generator_rows() if "generator/episodes" in r]
        return rows[-1]["generator/episodes"] if rows else 0

    def ledger(self) -> list[dict[str, Any]]:
        path = self.run_dir / "trainer" / "ledger.jsonl"
        if not path.exists():
            return []
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]

    def versions(self) -> list[dict[str, Any]]:
        """The trainer's weight-sync rounds (``<run_dir>/weightsync/versions.jsonl``: one line per published
        version, with ``round_s``, ``published_at`` and each generator's ack: ``transfer_ms``, ``pause_ms``)."""
        path = self.run_dir / "weightsync" / "versions.jsonl"
        if not path.exists():
            return []
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]

    def audit(self) -> dict[str, Any]:
        out = self.cli("brokers", "audit")
        assert out.stdout.strip().startswith("{"), out.stderr[-3000:]
        return orjson.loads(out.stdout)

    def wait_for(self, what: str, check: Callable[[], bool], timeout_s: float, *, alive: tuple[str, ...] = ()) -> None:
        """Poll ``check`` every 0.5 s until it holds; fails after ``timeout_s`` naming ``what`` (every wait of the
        tests is bounded here), or at once when a role named in ``alive`` has exited."""
        deadline = time.monotonic() + timeout_s
        while not check():
            for name in alive:
                proc = self.procs.get(name)
                assert proc is None or proc.poll() is None, f"{name} exited ({proc.poll()}):\n{self.log_tail(name)}"
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
            time.sleep(0.5)

