"""Hostile input through running roles: 10,000 bad records on the ``episodes`` topic for the buffer and 10,000 on
``batches`` for the trainer, interleaved with good ones. Every role keeps running, every bad record lands in the
dead-letter topic with a reason, the good ones are processed, and the audit still reconciles.

Kinds (mixed evenly): random bytes, truncated valid messages, byte-mutated valid messages (only those that no longer
decode), wrong schema versions, oversized payloads (over the role's ``kafka.max_message_bytes``), wrong tensor
shapes or dtypes, NaN rewards (episodes) or NaN advantages (batches).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter

import msgpack
import numpy as np
import pytest

from topics import codec
from topics.admin import read_topic
from topics.errors import CodecError
from topics.kafka import Producer
from topics.schemas import Batch, DeadLetter

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N = 10_000
ROLE_MAX_BYTES = 64 * 1024


def hostile(valid: object, n: int, seed: int, nan_field: str) -> list[bytes]:
    rng = random.Random(seed)
    good = codec.encode(valid)
    obj = msgpack.unpackb(good, raw=False)
    tensors = [s.name for s in codec._SPECS[type(valid)] if s.kind == "tensor"]
    out: list[bytes] = []
    kinds = ["random", "truncated", "mutated", "version", "oversized", "tensor", "nan"]
    while len(out) < n:
        kind = kinds[len(out) % len(kinds)]
        if kind == "random":
            data = rng.randbytes(rng.randrange(1, 300))
        elif kind == "truncated":
            data = good[: rng.randrange(len(good))]
        elif kind == "mutated":
            raw = bytearray(good)
            for _ in range(rng.randrange(1, 5)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            data = bytes(raw)
        elif kind == "version":
            data = msgpack.packb(dict(obj, v=rng.choice([0, 2, 99])), use_bin_type=True)
        elif kind == "oversized":
            data = msgpack.packb(dict(obj, padding=b"x" * (ROLE_MAX_BYTES + 10)), use_bin_type=True)
        elif kind == "tensor":
            name = rng.choice(tensors)
            data = msgpack.packb(dict(obj, **{name: dict(obj[name], dtype="float64")}), use_bin_type=True)
        else:
            data = msgpack.packb(dict(obj, **{nan_field: float("nan")} if nan_field == "reward" else {
                nan_field: dict(obj[nan_field], data=np.full(len(obj[nan_field]["data"]) // 4, np.nan,
                                                               dtype="<f4").tobytes())}), use_bin_type=True)
        try:
            codec.decode(data, max_bytes=ROLE_MAX_BYTES)
        except CodecError:
            out.append(data)  # only records a reader must reject
    return out


async def produce_raw(cfg, topic: str, records: list[bytes], key: str) -> None:
    async with Producer(cfg.kafka) as producer:
        futs = [await producer.enqueue_raw(topic, r, key=f"{key}{i % 7}") for i, r in enumerate(records)]
        await asyncio.gather(*futs)


def with_section(cfg, section: str, **kw):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})


async def wait_dead_letters(cfg, n: int, timeout_s: float, task: asyncio.Task) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if task.done():
            task.result()
            raise AssertionError("the role stopped")
        letters = await read_topic(cfg.kafka, cfg.names.dead_letter, expect=DeadLetter, idle_timeout_s=1)
        if len(letters) >= n:
            return letters
        await asyncio.sleep(2)
    raise AssertionError(f"only {len(letters)} of {n} dead letters after {timeout_s} s")


@pytest.mark.timeout(900)
async def test_buffer_survives_ten_thousand_bad_episodes(run_config) -> None:
    from buffer.audit import run_audit
    from buffer.service import BufferRole
    from buffer.synthetic import make_group

    cfg = with_section(run_config, "buffer", groups_per_batch=2, max_batch_wait_s=0.5)
    role_cfg = with_section(cfg, "kafka", max_message_bytes=ROLE_MAX_BYTES)
    good = [e for g in range(4) for e in make_group(f"good{g}", 4)]
    bad = hostile(good[0], N, seed=1, nan_field="reward")
    async with Producer(cfg.kafka) as producer:
        for e in good[:8]:
            await producer.send(cfg.names.episodes, e, key=e.group_id)
    await produce_raw(cfg, cfg.names.episodes, bad, "bad")
    async with Producer(cfg.kafka) as producer:
        for e in good[8:]:
            await producer.send(cfg.names.episodes, e, key=e.group_id)
    role = BufferRole(role_cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    try:
        letters = await wait_dead_letters(cfg, N, 600, task)
        deadline = time.monotonic() + 60
        while role.state.counters["batched_episodes"] < len(good) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert role.state.counters["batched_episodes"] == len(good)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    reasons = Counter(x.value.reason for x in letters)
    assert sum(reasons.values()) == N and set(reasons) <= {"malformed", "unknown_schema", "oversized", "invalid"}
    assert reasons["oversized"] > 0 and reasons["unknown_schema"] > 0 and reasons["invalid"] > 0
    audit = await run_audit(cfg)
    assert audit["lost"] == 0 and audit["batched"] == len(good) and audit["dropped"]["malformed"] == N, audit


@pytest.mark.timeout(900)
async def test_trainer_survives_ten_thousand_bad_batches(run_config, tmp_path) -> None:
    from consumers.ledger import Ledger
    from consumers.trainer import TrainerRole
    from producers.tiny_model import build_tiny_model

    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "trainer_role_batches", Path(__file__).resolve().parents[1] / "integration" / "test_trainer_role.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    make_batch = helpers.make_batch
    cfg = run_config
    cfg.model.path = str(build_tiny_model(tmp_path / "tiny", seed=0))
    cfg.trainer.max_steps = 2
    cfg.trainer.checkpoint_every = 100
    cfg.weightsync.transport = "file"
    cfg.weightsync.ack_deadline_s = 2.0
    cfg.kafka.max_message_bytes = ROLE_MAX_BYTES
    good = [make_batch(i) for i in range(2)]
    bad = hostile(good[0], N, seed=2, nan_field="advantages")
    big = dataclasses.replace(cfg.kafka, max_message_bytes=16 * 1024 * 1024)
    async with Producer(big) as producer:
        futs = [await producer.enqueue_raw(cfg.names.batches, r, key="bad") for r in bad]
        await asyncio.gather(*futs)
        for b in good:
            await producer.send(cfg.names.batches, b, key=b.batch_id)
    role = TrainerRole(cfg)
    await asyncio.wait_for(role.serve(), 600)
    assert role.finished_reason.startswith("max_steps")
    assert [r["batch_ids"] for r in Ledger.read(cfg.run_dir)] == [[b.batch_id] for b in good]
    letters = await read_topic(big, cfg.names.dead_letter, expect=DeadLetter)
    reasons = Counter(x.value.reason for x in letters)
    assert sum(reasons.values()) == N and all(x.value.source == cfg.names.batches for x in letters), reasons
    assert Batch  # the schema under test
