"""Run alone by ``tests/chaos/test_killed_runs.py`` (not collected by default: no ``test_`` file prefix): takes the
session's ``brokers`` fixture, prints their ports, and waits to be killed."""

from __future__ import annotations

import asyncio


async def test_hold_the_brokers(brokers) -> None:
    kafka_port = brokers.kafka_bootstrap.rsplit(":", 1)[1]
    nats_port = brokers.nats_url.rsplit(":", 1)[1]
    print(f"BROKERS {kafka_port} {nats_port}", flush=True)
    await asyncio.sleep(300)
