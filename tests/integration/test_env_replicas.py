"""Environment replicas as real processes (``streamforge run env``, OpenEnv under uvicorn) behind the router:
least-loaded sticky sessions checked from the replicas' own logs, typed outcomes, 1,000 hostile actions, a
replica SIGSTOPped then SIGKILLed mid-session, ``streamforge status``, and bad config that names its key."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import make_run_config

from envs.api import ActionRejected, EnvError, EnvStepFailed, EnvTimeout, ReplicaLost
from envs.config import EnvConfig
from envs.routing import ServiceEnvRouter
from helpers.replicas import ENV, ROOT, start_env_replica, stop
from runtime.services import ServiceDirectory
from topics.nats import connect

pytestmark = pytest.mark.timeout(120)

ROUTER_CFG = EnvConfig(name="count", heartbeat_s=0.5, health_timeout_s=1.5, step_timeout_s=5.0)


class Replicas:
    """Two replicas of ``count`` (``a``, ``b``) for the module, and a router in the test's process."""

    def __init__(self, cfg, logs: Path) -> None:
        self.cfg, self.logs = cfg, logs
        self.procs = {rid: start_env_replica(cfg, rid, logs / f"{rid}.log") for rid in ("count-a", "count-b")}
        self.nc = self.directory = self.router = None

    async def start(self) -> None:
        self.nc = await connect(self.cfg.nats, name="test-router")
        self.directory = ServiceDirectory(self.nc, self.cfg.names)
        await self.directory.start()
        await self.directory.wait_for("count", 2, timeout_s=90)
        self.router = ServiceEnvRouter(self.directory, ROUTER_CFG)

    def log(self, rid: str) -> str:
        return (self.logs / f"{rid}.log").read_text(errors="replace")

    async def close(self) -> None:
        if self.directory is not None:
            await self.directory.stop()
        if self.nc is not None:
            await self.nc.close()
        stop(list(self.procs.values()))


@pytest.fixture(scope="module")
async def replicas(brokers, tmp_path_factory):
    cfg = make_run_config(brokers, tmp_path_factory.mktemp("env-replicas") / "run")
    r = Replicas(cfg, Path(cfg.run.run_dir) / "logs")
    try:
        await r.start()
        yield r
    finally:
        await r.close()


async def test_sessions_go_to_the_least_loaded_replica_and_every_step_stays_on_it(replicas) -> None:
    router = replicas.router
    sessions = [await router.open("count") for _ in range(8)]
    placed = Counter(s.replica_id for s in sessions)
    assert set(placed) == {"count-a", "count-b"} and min(placed.values()) >= 2, placed  # spread by load

    async def episode(i: int, s) -> list[str]:
        texts = [(await s.reset(episode_id=f"sticky-{i}", options={"turns": 4})).text]
        for turn in range(4):
            await asyncio.sleep(random.random() * 0.02)  # interleave the sessions' steps
            obs = await s.step(f"move {turn}")
            texts.append(obs.text)
            assert obs.reward == 1.0 and obs.done == (turn == 3) and obs.info == {"turn": turn + 1}
        return texts

    results = await asyncio.gather(*(episode(i, s) for i, s in enumerate(sessions)))
    assert results[0] == ["episode sticky-0 starts", "turn 1: move 0", "turn 2: move 1", "turn 3: move 2",
                          "turn 4: move 3"]
    # the replicas report their live sessions as load in their beats
    await asyncio.sleep(ROUTER_CFG.heartbeat_s * 2.5)
    loads = {r.replica_id: r.beat.load for r in replicas.directory.healthy("count")}
    assert loads == dict(placed), (loads, placed)
    for s in sessions:
        await s.close()
    await asyncio.sleep(0.5)  # the servers' side of the closes
    # every reset and step of an episode is in the log of the replica its session was on, and in no other
    logs = {rid: replicas.log(rid) for rid in replicas.procs}
    # a client's close racing the server's is no error (envs/serving.py): no traceback per session
    assert not any("Exception in ASGI application" in text for text in logs.values())
    for i, s in enumerate(sessions):
        for rid, text in logs.items():
            lines = re.findall(rf"replica {rid} session \d+ (\w+) episode=sticky-{i}\n", text)
            if rid == s.replica_id:  # its close may or may not have reached the log yet
                assert lines in (["reset", *["step"] * 4], ["reset", *["step"] * 4, "close"]), (i, rid, lines)
            else:
                assert lines == [], (i, rid, lines)


async def test_step_outcomes_are_typed_and_a_session_survives_rejections_and_failures(replicas) -> None:
    router = replicas.router
    s = await router.open("count")
    try:
        await s.reset(episode_id="outcomes", options={"turns": 100})
        with pytest.raises(ActionRejected, match="validator refuses"):
            await s.step("reject this")
        with pytest.raises(ActionRejected, match="illegal move"):
            await s.step("illegal")
        with pytest.raises(EnvStepFailed, match="the environment broke") as failed:
            await s.step("boom")
        assert failed.value.replica_id == s.replica_id and not failed.value.retriable
        assert (await s.step("fine")).text == "turn 1: fine"  # the session goes on
        t0 = time.monotonic()
        with pytest.raises(EnvTimeout):
            await s.step("sleep:3", timeout_s=0.5)
        assert time.monotonic() - t0 < 1.5
        with pytest.raises(EnvTimeout):  # a timed-out session is closed: a late answer is never taken for another
            await s.step("fine")
    finally:
        await s.close()


def hostile_actions(n: int, seed: int = 0) -> list[str]:
    """Garbage text, oversized, every kind of unicode, empty, protocol look-alikes, and the misbehaving actions."""
    rng = random.Random(seed)
    fixed = ["", " ", "\n" * 50, "\x00", "\x00\x01\x02\x1b[31m", "\ud800", "a\udfffb", "😀" * 1000,
             "\u202eevil\u202c", "e\u0301" * 200, "漢字かなカナ", "\ufeff", '{"type":"close"}', '"}], "type": "step',
             "null", "[]", "\\u0000", "boom", "illegal", "reject", "x" * 65536, "x" * 65537, "y" * 1_000_000,
             "sleep:0.001", "text", "%s%n%x", "<script>alert(1)</script>", "' OR 1=1 --"]
    out = list(fixed)
    while len(out) < n:
        kind = rng.randrange(5)
        if kind == 0:  # random bytes decoded with replacement characters
            out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))).decode("utf-8", "replace"))
        elif kind == 1:  # random code points, surrogates included
            out.append("".join(chr(rng.randrange(0x110000)) for _ in range(rng.randrange(1, 50))))
        elif kind == 2:  # long
            out.append(rng.choice("ab\u00e9\u4e2d") * rng.randrange(1000, 100_000))
        elif kind == 3:
            out.append(rng.choice(["boom", "illegal", "reject!", ""]))
        else:
            out.append(" ".join(rng.choice(["hit", "stand", "<calc>1+1</calc>", "\t"]) for _ in range(5)))
    return out[:n]


async def test_a_thousand_hostile_actions_through_a_real_replica_crash_nothing_and_are_all_counted(replicas) -> None:
    router = replicas.router
    s = await router.open("count", exclude=["count-b"])
    outcomes: Counter[str] = Counter()
    before = Counter(router.counts)
    try:
        await s.reset(episode_id="hostile", options={"turns": 10**9})
        for action in hostile_actions(1000):
            try:
                obs = await s.step(action)
                assert isinstance(obs.text, str)
                outcomes["ok"] += 1
            except EnvError as exc:
                assert not isinstance(exc, (ReplicaLost, EnvTimeout)), exc  # the replica never went away
                outcomes[exc.reason] += 1
    finally:
        await s.close()
    assert sum(outcomes.values()) == 1000, outcomes
    assert outcomes["ok"] > 400 and outcomes["action_rejected"] > 50 and outcomes["env_step_failed"] > 20, outcomes
    counted = Counter(router.counts)
    counted.subtract(before)
    assert counted["step"] == outcomes["ok"] and counted["rejected"] == outcomes["action_rejected"]
    assert counted["failed"] == outcomes["env_step_failed"] and counted["lost"] == 0
    assert replicas.procs["count-a"].poll() is None
    s2 = await router.open("count", exclude=["count-b"])  # the replica serves on
    try:
        assert (await s2.reset(episode_id="after-hostile")).text == "episode after-hostile starts"
    finally:
        await s2.close()


async def test_a_stopped_then_killed_replica_loses_its_sessions_in_time_and_routing_moves_on(replicas) -> None:
    cfg, router, directory = replicas.cfg, replicas.router, replicas.directory
    victim = start_env_replica(cfg, "count-v", replicas.logs / "count-v.log")
    try:
        await directory.wait_for("count", 3, timeout_s=90)
        s = await router.open("count", exclude=["count-a", "count-b"])
        assert s.replica_id == "count-v"
        await s.reset(episode_id="victim-1", options={"turns": 100})
        await s.step("before the stop")
        # hung (SIGSTOP): no answer, no beat. Pings lose the session, beats stop routing, both within the timeout
        victim.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ReplicaLost):
            await s.step("into the void")
        assert time.monotonic() - t0 <= ROUTER_CFG.health_timeout_s + 0.5
        while any(r.replica_id == "count-v" for r in directory.healthy("count")):
            assert time.monotonic() - t0 <= ROUTER_CFG.health_timeout_s + 0.5, "still routed to a silent replica"
            await asyncio.sleep(0.02)
        for _ in range(3):
            other = await router.open("count")
            assert other.replica_id != "count-v"
            await other.close()
        # it wakes up and beats again: back in routing
        victim.send_signal(signal.SIGCONT)
        t1 = time.monotonic()
        while not any(r.replica_id == "count-v" for r in directory.healthy("count")):
            assert time.monotonic() - t1 < 10, "a replica that beats again is not routed to"
            await asyncio.sleep(0.05)
        s = await router.open("count", exclude=["count-a", "count-b"])
        await s.reset(episode_id="victim-2", options={"turns": 100})
        # SIGKILL mid-step: the kernel closes its socket, the session knows at once
        step = asyncio.ensure_future(s.step("sleep:5"))
        await asyncio.sleep(0.3)
        victim.kill()
        t2 = time.monotonic()
        with pytest.raises(ReplicaLost) as lost:
            await step
        assert time.monotonic() - t2 < 1.0 and lost.value.retriable and lost.value.replica_id == "count-v"
        nxt = await router.open("count")  # the next open goes to a replica that lives
        assert nxt.replica_id in ("count-a", "count-b")
        assert (await nxt.reset(episode_id="victim-2")).text == "episode victim-2 starts"
        await nxt.close()
    finally:
        stop([victim])


async def test_status_lists_the_replicas_with_load_and_health(replicas) -> None:
    from streamforge.status import nats_status

    s = await replicas.router.open("count")
    try:
        await asyncio.sleep(ROUTER_CFG.heartbeat_s * 2.5)
        status = await nats_status(replicas.cfg, listen_s=0.1)
    finally:
        await s.close()
    rows = {r["replica_id"]: r for r in status["services"]["count"] if r["healthy"]}
    assert {"count-a", "count-b"} <= set(rows)
    assert rows[s.replica_id]["load"] >= 1 and rows[s.replica_id]["capacity"] == 16
    assert all(r["kind"] == "env" and r["address"].startswith("ws://") and r["state"] == "serving"
               for r in rows.values())


@pytest.mark.parametrize(("args", "key"), [
    (["--env.impl=helpers.countenv:CountEnv"], "env.name"),
    (["--env.name=count"], "env.impl"),
    (["--env.name=count", "--env.impl=helpers.nosuch:Env"], "env.impl"),
    (["--env.name=count.x", "--env.impl=helpers.countenv:CountEnv"], "env.name"),
])
def test_run_env_with_bad_config_fails_naming_the_key(tmp_path: Path, args: list[str], key: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "streamforge", "run", "env", "--run.run_dir=" + str(tmp_path),
                           "--nats.url=nats://127.0.0.1:1", *args], capture_output=True, text=True, timeout=60,
                          env=ENV, cwd=ROOT)
    assert proc.returncode != 0
    assert f"config key '{key}'" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
