"""``streamforge status``: policy versions (latest and per generator) from NATS, lag and throughput from Kafka."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from topics import codec
from topics.admin import group_offsets, highwaters
from topics.nats import PolicyStore, connect
from topics.schemas import Membership, VersionAck


async def kafka_status(config: Any, *, interval_s: float = 1.0) -> dict[str, Any]:
    names = config.names
    groups = {names.prompts: names.generators_group, names.episodes: names.buffers_group,
              names.batches: names.trainers_group}
    first = {t: await highwaters(config.kafka, t) for t in names.topics()}
    t0 = time.monotonic()
    await asyncio.sleep(interval_s)
    second = {t: await highwaters(config.kafka, t) for t in names.topics()}
    elapsed = time.monotonic() - t0
    out: dict[str, Any] = {}
    for topic in names.topics():
        total = sum(second[topic].values())
        row: dict[str, Any] = {"records": total,
                               "records_per_s": round((total - sum(first[topic].values())) / elapsed, 2)}
        group = groups.get(topic)
        if group:
            committed = await group_offsets(config.kafka, group, topic)
            lag = sum(hw - committed.get(p, 0) for p, hw in second[topic].items())
            row.update({"group": group, "lag": lag})
        out[topic] = row
    return out


async def nats_status(config: Any) -> dict[str, Any]:
    nc = await connect(config.nats, name="streamforge-status")
    try:
        store = PolicyStore(nc, config.names, timeout_s=config.nats.request_timeout_s)
        await store.start()
        latest, revision = await store.latest()
        generators: dict[str, Any] = {}
        try:
            keys = await store.kv.keys()
        except Exception:  # no keys at all
            keys = []
        for key in keys:
            if key == config.names.LATEST_KEY:
                continue
            raw = await store.get(key)
            if not raw:
                continue
            try:
                msg = codec.decode(raw)
            except Exception:
                generators[key] = {"error": "undecodable"}
                continue
            if isinstance(msg, VersionAck):
                generators.setdefault(msg.generator_id, {}).update(
                    {"version": msg.version, "ok": msg.ok, "acked_at": msg.created_at, "pause_ms": msg.pause_ms})
            elif isinstance(msg, Membership):
                generators.setdefault(msg.generator_id, {}).update({"event": msg.event, "seen_at": msg.created_at})
        return {
            "latest_version": None if latest is None else latest.version,
            "latest_step": None if latest is None else latest.step,
            "revision": revision,
            "generators": generators,
        }
    finally:
        await nc.close()


async def status(config: Any, *, interval_s: float = 1.0) -> dict[str, Any]:
    return {"policy": await nats_status(config), "topics": await kafka_status(config, interval_s=interval_s)}
