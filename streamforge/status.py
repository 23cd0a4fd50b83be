"""``streamforge status``: policy versions (latest and per generator) from NATS, lag and throughput from Kafka.

``services`` lists every service's replicas from the services bucket (``runtime/services.py``): kind, address,
load against capacity, state (serving or draining), the age of its last beat and whether that makes it healthy.
``evaluator``: the last row of ``<run_dir>/eval.jsonl`` and how many versions were evaluated (absent without one).
``buffers``: each buffer's health from ``<run_dir>/health-<buffer_id>.json`` (``buffer/gaps.py``): ``state`` ("ok" or
"failing": an offset gap it cannot read past, named in ``reason`` and ``gaps``), ``updated_at`` (absent without any).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson

from runtime.services import read_services
from topics import codec
from topics.admin import group_lag, highwaters
from topics.nats import PolicyStore, connect
from topics.schemas import Membership, VersionAck


async def kafka_status(config: Any, *, interval_s: float = 1.0) -> dict[str, Any]:
    names = config.names
    groups = names.consumer_groups()
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
            row.update({"group": group, "lag": await group_lag(config.kafka, group, topic, second[topic])})
        out[topic] = row
    return out


async def nats_status(config: Any, *, listen_s: float = 2.5) -> dict[str, Any]:
    """Latest version from the KV bucket, fenced generators from its ``fenced`` key, and each generator's loaded
    version from what it says on the membership (heartbeats carry it) and ack subjects during ``listen_s``."""
    nc = await connect(config.nats, name="streamforge-status")
    try:
        store = PolicyStore(nc, config.names, timeout_s=config.nats.request_timeout_s)
        await store.start()
        latest, revision = await store.latest_good()
        generators: dict[str, dict[str, Any]] = {}

        async def on_msg(msg: Any) -> None:
            try:
                m = codec.decode(msg.data)
            except Exception:  # noqa: BLE001 - a status reader skips what it cannot read
                return
            if isinstance(m, VersionAck):
                generators.setdefault(m.generator_id, {}).update(
                    {"version": m.version, "ok": m.ok, "acked_at": m.created_at, "pause_ms": m.pause_ms})
            elif isinstance(m, Membership):
                row = generators.setdefault(m.generator_id, {})
                row.update({"event": m.event, "seen_at": m.created_at, "host": m.host, "pid": m.pid})
                if m.version >= 0:
                    row.setdefault("version", m.version)

        subs = [await nc.subscribe(config.names.ack_subject, cb=on_msg),
                await nc.subscribe(config.names.membership_subject, cb=on_msg)]
        await asyncio.sleep(listen_s)
        for sub in subs:
            await sub.unsubscribe()
        raw_fenced = await store.get("fenced")
        try:
            fenced = orjson.loads(raw_fenced) if raw_fenced else {}
        except orjson.JSONDecodeError:
            fenced = {"error": "undecodable fencing record"}
        try:
            services: dict[str, Any] = await read_services(nc, config.names, timeout_s=config.nats.request_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a status reader reports what it cannot read (e.g. no permission)
            services = {"error": f"{type(exc).__name__}: {exc}"}
        return {
            "services": services,
            "latest_version": None if latest is None else latest.version,
            "latest_step": None if latest is None else latest.step,
            "revision": revision,
            "generators": generators,
            "fenced": fenced,
        }
    finally:
        await nc.close()


def eval_status(run_dir: Any) -> dict[str, Any] | None:
    """The evaluator's last row (``producers/evaluator.py``) and its count of evaluations; None without any."""
    from runtime.telemetry import read_jsonl

    path = run_dir / "eval.jsonl"
    rows = read_jsonl(path) if path.exists() else []
    return {"evaluations": len(rows), "last": rows[-1]} if rows else None


def buffer_health(run_dir: Any) -> dict[str, Any] | None:
    """``{buffer_id: {state, reason, gaps, updated_at}}`` from the buffers' health files; None without any."""
    out: dict[str, Any] = {}
    for path in sorted(Path(run_dir).glob("health-*.json")):
        try:
            row = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue  # being replaced, or not one of ours
        if isinstance(row, dict) and row.get("role") == "buffer":
            out[str(row.get("id", path.stem.removeprefix("health-")))] = {
                k: row.get(k) for k in ("state", "reason", "gaps", "updated_at")}
    return out or None


async def status(config: Any, *, interval_s: float = 1.0) -> dict[str, Any]:
    policy, topics = await asyncio.gather(nats_status(config, listen_s=max(interval_s, 2.5)),
                                          kafka_status(config, interval_s=interval_s))
    out = {"policy": policy, "services": policy.pop("services"), "topics": topics}
    if (evaluator := eval_status(config.run_dir)) is not None:
        out["evaluator"] = evaluator
    if (buffers := buffer_health(config.run_dir)) is not None:
        out["buffers"] = buffers
    return out
