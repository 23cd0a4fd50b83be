"""``streamforge tail``: decode and print the messages of a topic as JSON lines."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from typing import Any

import numpy as np
import orjson

from topics.admin import reader_from_start
from topics.config import KafkaConfig
from topics.kafka import Received


def summarize(value: Any, *, full: bool = False) -> Any:
    """A JSON-friendly view of a decoded message: arrays shown as dtype/shape/head unless ``full``."""
    if dataclasses.is_dataclass(value):
        out = {"schema": type(value).SCHEMA}
        out.update({f.name: summarize(getattr(value, f.name), full=full) for f in dataclasses.fields(value)})
        return out
    if isinstance(value, np.ndarray):
        if full or value.size <= 16:
            return value.tolist()
        return {"dtype": value.dtype.name, "shape": list(value.shape), "head": value.reshape(-1)[:8].tolist()}
    if isinstance(value, bytes):
        return value[:64].hex() + ("..." if len(value) > 64 else "")
    if isinstance(value, dict):
        return {k: summarize(v, full=full) for k, v in value.items()}
    if isinstance(value, list):
        return [summarize(v, full=full) for v in value]
    return value


def record_line(rec: Received, *, full: bool = False) -> bytes:
    row: dict[str, Any] = {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset, "key": rec.key}
    if rec.error is not None:
        row["error"] = {"type": type(rec.error).__name__, "reason": rec.error.reason, "detail": str(rec.error)}
        row["raw"] = rec.raw[:64].hex()
    else:
        row["message"] = summarize(rec.value, full=full)
    return orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY, default=str)


async def tail(cfg: KafkaConfig, topic: str, *, follow: bool, max_messages: int, full: bool,
               out: Any = None) -> int:
    """Print a topic from the beginning; with ``follow`` keep waiting for new records. Returns the count."""
    out = out or sys.stdout.buffer
    consumer, tps = await reader_from_start(cfg, topic, client_id="streamforge-tail")
    count = 0
    try:
        idle = 0
        while max_messages <= 0 or count < max_messages:
            records = await consumer.getmany(timeout_ms=500)
            for rec in records:
                out.write(record_line(rec, full=full) + b"\n")
                count += 1
                if 0 < max_messages <= count:
                    break
            out.flush()
            if records:
                idle = 0
                continue
            caught_up = True
            for tp in tps:
                hw = consumer.highwater(tp)
                if hw is None or await consumer.position(tp) < hw:
                    caught_up = False
            idle += 1
            if not follow and (caught_up or idle > 10):
                break
            if follow:
                await asyncio.sleep(0)
    finally:
        await consumer.stop()
    return count
