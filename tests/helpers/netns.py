"""Test hosts on one machine: Linux network namespaces joined by veth pairs to a bridge (``ip netns``, iproute2).

``Hosts(["brokers", "trainer", "generator"])`` makes one namespace per host, ``sfh-<pid>-<host>``, and a switch
namespace ``sfh-<pid>-sw`` holding the bridge ``br0``. Host ``i`` has one interface ``eth0`` (its veth peer ``p<i>``
sits on the bridge) with the address ``<subnet>.<i + 1>/24``, and its own loopback. Nothing is routed out of the
namespaces: every address is on the private subnet and no namespace has a default route, so all traffic stays
inside them (the test process itself, in the root namespace, reaches none of them: it runs commands inside).

Faults, each undone by its counterpart:

* ``cut(host)`` / ``mend(host)``: the host's cable pulled, i.e. its switch port ``p<i>`` down (packets to and from
  the host vanish silently; its own ``eth0`` stays up with its address, as a real host's would);
* ``blackhole(host, ip)`` / ``unblackhole(host, ip)``: a ``blackhole`` route on the host for one address (a route
  removed: that peer alone becomes unreachable, silently);
* ``limit(host, rate)`` / ``unlimit(host)``: a ``tbf`` qdisc on the host's ``eth0`` (its egress bandwidth);
* ``kill(host)``: SIGKILL to every process in the host's namespace (a host lost whole).

``close()`` kills every process left in the namespaces and deletes them; ``remove_leftovers()`` does the same for
namespaces of this prefix whose creating process is dead (a previous run killed before it could clean up). Needs
root (``can_create()`` says whether namespaces can be made here); this kernel has no ``netem`` and no iptables.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

PREFIX = "sfh-"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def ns_pids(ns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def kill_ns(ns: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process in namespace ``ns`` until none is left (children forked meanwhile included);
    returns the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while (pids := ns_pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.05)
    return killed


def delete_ns(ns: str) -> None:
    kill_ns(ns)
    _ip("netns", "delete", ns, check=False)


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces of ``prefix`` whose creating process (the pid in their name) is gone."""
    gone = []
    for ns in namespaces():
        if not ns.startswith(prefix):
            continue
        owner = ns[len(prefix):].split("-", 1)[0]
        if owner.isdigit() and Path(f"/proc/{owner}").exists():
            continue  # another live test session's hosts
        delete_ns(ns)
        gone.append(ns)
    return gone


def can_create() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"ip netns add failed: {out.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return ""


class Hosts:
    """Namespaces named ``sfh-<pid>-<host>`` on a bridge; see the module docstring."""

    def __init__(self, names: Sequence[str], *, subnet: str = "10.231.0") -> None:
        self.names = list(names)
        self.subnet = subnet
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.ns = {name: f"{self.tag}-{name}" for name in self.names}
        self.addr = {name: f"{subnet}.{i + 1}" for i, name in enumerate(self.names)}
        self.port = {name: f"p{i}" for i, name in enumerate(self.names)}
        self.extra: dict[str, list[str]] = {name: [] for name in self.names}
        self._made: list[str] = []

    # -- building ---------------------------------------------------------------------------------
    def create(self) -> Self:
        remove_leftovers()
        try:
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for name in self.names:
                ns, port = self.ns[name], self.port[name]
                self._add_ns(ns)
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def add_address(self, host: str, last_octet: int) -> str:
        """A second address on ``host``'s ``eth0`` (a service of its own that a peer can lose alone)."""
        ip = f"{self.subnet}.{last_octet}"
        _ip("-n", self.ns[host], "addr", "add", f"{ip}/24", "dev", "eth0")
        self.extra[host].append(ip)
        return ip

    def close(self) -> None:
        """Kill every process in the namespaces and delete them (also after a failed ``create``)."""
        for ns in reversed(self._made):
            delete_ns(ns)
        self._made = []

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running ----------------------------------------------------------------------------------
    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """``argv`` started inside ``host`` (in a session of its own, so a test can signal its whole group)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.argv(host, argv), **kwargs)

    def run(self, host: str, argv: Sequence[str], *, timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(host, argv), timeout=timeout, **kwargs)

    def pids(self, host: str) -> list[int]:
        return ns_pids(self.ns[host])

    # -- faults -----------------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port[host], "down")

    def mend(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port[host], "up")

    def blackhole(self, host: str, ip: str) -> None:
        _ip("-n", self.ns[host], "route", "add", "blackhole", f"{ip}/32")

    def unblackhole(self, host: str, ip: str) -> None:
        _ip("-n", self.ns[host], "route", "del", "blackhole", f"{ip}/32")

    def limit(self, host: str, rate: str, *, burst: str = "32kbit", latency: str = "400ms") -> None:
        """``tbf`` on ``host``'s egress: ``rate`` like ``"8mbit"``."""
        subprocess.run(["ip", "netns", "exec", self.ns[host], "tc", "qdisc", "replace", "dev", "eth0", "root",
                        "tbf", "rate", rate, "burst", burst, "latency", latency], check=True, capture_output=True)

    def unlimit(self, host: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.ns[host], "tc", "qdisc", "del", "dev", "eth0", "root"],
                       check=False, capture_output=True)

    def kill(self, host: str) -> list[int]:
        """SIGKILL every process in ``host``'s namespace; returns their pids."""
        return kill_ns(self.ns[host])
