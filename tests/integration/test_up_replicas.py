"""What ``up`` does for the service layer, with real processes: it starts ``up.envs`` environment replicas and
``up.rewards`` reward replicas and waits until each one beats before it starts the generators; a replica that
dies first stops the wait with its name (``streamforge/replicas.py``); SIGTERM drains a replica out of the bucket."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest
from conftest import make_run_config

from helpers.replicas import ENV, common_args
from runtime.services import ServiceDirectory
from streamforge.replicas import expected_replicas, replica_children, wait_registered
from streamforge.up import Child
from topics.nats import connect

pytestmark = pytest.mark.timeout(120)

SERVICES = ["--env.name=count", "--env.impl=helpers.countenv:CountEnv", "--up.envs=2", "--env.heartbeat_s=0.5",
            "--env.health_timeout_s=1.5", "--reward.name=judge", "--reward.impl=services.reward_examples:toy_judge",
            "--up.rewards=1", "--reward.heartbeat_s=0.5", "--reward.health_timeout_s=1.5"]


def children_of(cfg, overrides: list[str]) -> list[Child]:
    """The replica children ``up`` would start for ``cfg`` (the same command lines)."""
    def child(name: str, role: str, extra: list[str]) -> Child:
        argv = [sys.executable, "-m", "streamforge", "run", role, *common_args(cfg), *overrides, *extra]
        return Child(name, role, argv, Path(cfg.run.run_dir) / "logs" / f"{name}.log", env=ENV)

    return replica_children(cfg, child)


async def test_up_starts_the_replicas_and_waits_until_each_one_beats(brokers, tmp_path: Path) -> None:
    cfg = make_run_config(brokers, tmp_path / "run", SERVICES)
    children = children_of(cfg, SERVICES)
    assert [(c.name, c.role) for c in children] == [("env-0", "env"), ("env-1", "env"), ("reward-0", "reward")]
    assert expected_replicas(cfg, children) == {"count": {"count-0", "count-1"}, "judge": {"judge-0"}}
    nc = await connect(cfg.nats, name="test-up-replicas")
    directory = ServiceDirectory(nc, cfg.names)
    try:
        for c in children:
            c.start()
        assert await wait_registered(cfg, children, asyncio.Event()) == ""
        assert all(c.poll() is None for c in children)
        await directory.start()
        assert {r.replica_id for r in directory.healthy("count")} == {"count-0", "count-1"}
        # the first SIGTERM drains: each replica leaves the bucket (callers drop it at once) and exits 0
        for c in children:
            c.signal(signal.SIGTERM)
        codes = [await asyncio.to_thread(c.proc.wait, 30) for c in children]
        assert codes == [0, 0, 0], [c.log_tail() for c in children]
        await asyncio.sleep(0.3)
        assert directory.replicas.get("count") == {} and directory.replicas.get("judge") == {}
    finally:
        await directory.stop()
        await nc.close()
        for c in children:
            c.signal(15)
        for c in children:
            await asyncio.to_thread(c.reap, 15)


async def test_a_replica_that_dies_before_it_registers_stops_the_wait(brokers, tmp_path: Path) -> None:
    overrides = ["--env.name=count", "--env.impl=helpers.nosuch:Env", "--up.envs=1", "--up.service_wait_s=60"]
    cfg = make_run_config(brokers, tmp_path / "run", overrides)
    children = children_of(cfg, overrides)
    try:
        for c in children:
            c.start()
        why = await wait_registered(cfg, children, asyncio.Event())
        assert why.startswith("env-0 exited with code 1 before it registered"), why
        assert "config key 'env.impl'" in children[0].log_tail()
    finally:
        for c in children:
            await asyncio.to_thread(c.reap, 5)
