"""``up``'s service replicas: the environment and reward replicas it starts, and the wait for them to register.

``replica_children(config, child)`` lists the ``streamforge run env`` children (``up.envs`` of them when
``env.name`` is set: replica ids ``<env.name>-<i>``) and the ``streamforge run reward`` children (``up.rewards`` of
them when ``reward.impl`` is set: ``<reward.name>-<i>``). ``up`` starts them with the other roles and starts the
generators only once ``wait_registered`` has seen every one of them beat in the services bucket (or stops the run if
one exits first, or none registered within ``up.service_wait_s``), so a generator's first episode finds a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from runtime.services import ServiceDirectory
from topics.errors import TimeoutExpired
from topics.nats import connect


def replica_children(config: Any, child: Callable[..., Any]) -> list[Any]:
    """The replica children of the run (module docstring); ``child(name, role, extra_args)`` builds one."""
    out = []
    if config.env.name:
        out += [child(f"env-{i}", "env", [f"--env.replica_id={config.env.name}-{i}"]) for i in range(config.up.envs)]
    if config.reward.impl:
        out += [child(f"reward-{i}", "reward", [f"--reward.replica_id={config.reward.name}-{i}"])
                for i in range(config.up.rewards)]
    return out


def expected_replicas(config: Any, children: list[Any]) -> dict[str, set[str]]:
    """``{service: {replica ids}}`` the replica children will register."""
    out: dict[str, set[str]] = {}
    for c in children:
        service = config.env.name if c.role == "env" else config.reward.name
        out.setdefault(service, set()).add(f"{service}-{c.name.rsplit('-', 1)[1]}")
    return out


async def wait_registered(config: Any, children: list[Any], stop: asyncio.Event) -> str:
    """Wait until every replica child beats (woken by each beat, checking the children every 0.5 s); "" when they
    all do, else why not (a child exited, ``up.service_wait_s`` ran out, or ``stop`` was set)."""
    if not children:
        return ""
    expected = expected_replicas(config, children)
    nc = await connect(config.nats, name="up-replicas")
    directory = ServiceDirectory(nc, config.names, timeout_s=config.nats.request_timeout_s)
    try:
        await directory.start()
        deadline = time.monotonic() + config.up.service_wait_s
        while True:
            missing = {s: ids - {r.replica_id for r in directory.healthy(s)} for s, ids in expected.items()}
            missing = {s: ids for s, ids in missing.items() if ids}
            if not missing:
                return ""
            dead = [c for c in children if c.poll() is not None]
            if dead:
                return "; ".join(f"{c.name} exited with code {c.poll()} before it registered" for c in dead)
            if stop.is_set():
                return "stopped while waiting for the service replicas"
            if time.monotonic() > deadline:
                return f"replicas not registered after up.service_wait_s = {config.up.service_wait_s} s: {missing}"
            service = next(iter(missing))
            with contextlib.suppress(TimeoutExpired):  # woken by a beat; a dead child is seen within 0.5 s
                await directory.wait_for(service, len(expected[service]), timeout_s=0.5)
    finally:
        await directory.stop()
        await nc.close()
