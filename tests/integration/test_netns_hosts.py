"""The test hosts themselves (``tests/helpers/netns.py``): namespaces are made, hosts reach each other across the
bridge, a pulled cable and a blackhole route block exactly what they should, a ``tbf`` limit slows a transfer, a
killed host has no process left, and closing removes every namespace (also a crashed run's leftovers). A few
seconds; skipped where namespaces cannot be made (not root)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers.netns import PREFIX, Hosts, can_create, namespaces, remove_leftovers

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 7000)); s.listen(8)
print("listening", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"x" * int(sys.argv[2])); c.close()
"""
CLIENT = """
import socket, sys, time
t = time.perf_counter()
try:
    c = socket.create_connection((sys.argv[1], 7000), timeout=1.0); n = 0
    while (b := c.recv(65536)):
        n += len(b)
    print(n, round(time.perf_counter() - t, 3))
except OSError as exc:
    print("ERR", exc)
"""
SIZE = 200_000


@pytest.fixture
def hosts():
    why = can_create()
    if why:
        pytest.skip(why)
    with Hosts(["a", "b", "c"], subnet="10.232.0") as h:
        yield h


def fetch(h: Hosts, host: str, ip: str) -> str:
    return h.run(host, [sys.executable, "-c", CLIENT, ip], timeout=20).stdout.strip()


def test_hosts_connect_partition_limit_kill_and_clean_up(hosts: Hosts) -> None:
    made = set(namespaces())
    assert {hosts.switch, *hosts.ns.values()} <= made
    server = hosts.popen("a", [sys.executable, "-c", SERVER, hosts.addr["a"], str(SIZE)], stdout=subprocess.PIPE)
    assert server.stdout.readline().strip() == b"listening"
    a = hosts.addr["a"]
    assert fetch(hosts, "b", a).startswith(f"{SIZE} ")
    assert fetch(hosts, "c", a).startswith(f"{SIZE} ")
    # the root namespace (this process) reaches none of them
    assert subprocess.run([sys.executable, "-c", CLIENT, a], capture_output=True, text=True).stdout.startswith("ERR")

    hosts.cut("b")  # b's cable: b alone is cut off, silently (a timeout, not a refusal)
    assert "timed out" in fetch(hosts, "b", a)
    assert fetch(hosts, "c", a).startswith(f"{SIZE} ")
    hosts.mend("b")
    assert fetch(hosts, "b", a).startswith(f"{SIZE} ")

    hosts.blackhole("c", a)  # c loses a's address alone
    assert fetch(hosts, "c", a).startswith("ERR")
    assert fetch(hosts, "b", a).startswith(f"{SIZE} ")
    hosts.unblackhole("c", a)
    assert fetch(hosts, "c", a).startswith(f"{SIZE} ")

    free_s = float(fetch(hosts, "b", a).split()[1])
    hosts.limit("a", "1mbit")  # 200 kB at 1 Mbit/s: about 1.6 s
    limited_s = float(fetch(hosts, "b", a).split()[1])
    hosts.unlimit("a")
    assert limited_s > 1.0 > free_s, (free_s, limited_s)

    assert hosts.pids("a") == [server.pid]
    assert hosts.kill("a") == [server.pid]
    assert server.wait(5) == -9 and hosts.pids("a") == []

    hosts.close()
    assert not {hosts.switch, *hosts.ns.values()} & set(namespaces())


def test_leftovers_of_a_dead_run_are_removed() -> None:
    why = can_create()
    if why:
        pytest.skip(why)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-x"  # named as a run of a process that is gone
    subprocess.run(["ip", "netns", "add", stale], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])
    time.sleep(0.2)
    try:
        assert stale in remove_leftovers()
        assert stale not in namespaces()
        assert sleeper.wait(5) == -9
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)
        if sleeper.poll() is None:
            sleeper.kill()
