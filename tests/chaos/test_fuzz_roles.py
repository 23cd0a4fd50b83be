"""Hostile input through running roles, 1,000 bad messages per kind of input, interleaved with good ones: the
``episodes`` topic (buffer), ``batches`` and ``sft`` (trainer), ``prompts`` (generator on real vLLM, plus prompts
that decode but no engine can take), the NATS KV latest-version and fencing keys (buffer) and the membership and ack
subjects (trainer). ``drops`` and ``dead-letter`` are read only by tools (audit, tail), which skip what they cannot
decode; the policy-notification subject has no subscriber among the roles (they watch the KV key). Every
role keeps running, every bad message lands in the dead-letter topic with a reason, the good ones are processed, and
the audit still reconciles.

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

from helpers.audits import assert_nothing_lost
from topics import codec
from topics.admin import read_topic
from topics.errors import CodecError
from topics.kafka import Producer
from topics.schemas import Batch, DeadLetter

N = 1_000  # per input; the codec's own rejection of each kind is fuzzed 10,000 times a kind in tests/unit/test_fuzz_codec.py
ROLE_MAX_BYTES = 64 * 1024


def hostile(valid: object, n: int, seed: int, nan_field: str, max_bytes: int = ROLE_MAX_BYTES) -> list[bytes]:
    rng = random.Random(seed)
    good = codec.encode(valid)
    obj = msgpack.unpackb(good, raw=False)
    tensors = [s.name for s in codec._SPECS[type(valid)] if s.kind == "tensor"]
    out: list[bytes] = []
    kinds = ["random", "truncated", "mutated", "version", "oversized", "tensor", "nan"]
    attempts = 0
    while len(out) < n:
        kind = kinds[attempts % len(kinds)]  # by attempt: a kind that never fails to decode cannot stall the loop
        attempts += 1
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
            if not tensors:
                continue  # a schema without tensor fields
            name = rng.choice(tensors)
            data = msgpack.packb(dict(obj, **{name: dict(obj[name], dtype="float64")}), use_bin_type=True)
        else:
            data = msgpack.packb(dict(obj, **{nan_field: float("nan")} if nan_field == "reward" else {
                nan_field: dict(obj[nan_field], data=np.full(len(obj[nan_field]["data"]) // 4, np.nan,
                                                               dtype="<f4").tobytes())}), use_bin_type=True)
        try:
            codec.decode(data, max_bytes=max_bytes)
        except CodecError:
            out.append(data)  # only records a reader must reject
    return out


async def produce_raw(cfg, topic: str, records: list[bytes], key: str) -> None:
    async with Producer(cfg.kafka) as producer:
        futs = [await producer.enqueue_raw(topic, r, key=f"{key}{i % 7}") for i, r in enumerate(records)]
        await asyncio.gather(*futs)


def with_section(cfg, section: str, **kw):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})


async def kv_values_under_buffer(cfg, key: str, bad: list[bytes], good: bytes, adopted) -> tuple:
    """Write ``bad`` then ``good`` to the policy bucket's ``key`` under a running buffer; wait until
    ``adopted(role)`` and until every bad value is dead-lettered. Returns the stopped role and the dead letters."""
    from streamforge.roles import build_role
    from topics.nats import PolicyStore, connect

    role = build_role("buffer", cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    nc = await connect(cfg.nats, name="fuzz")
    try:
        store = PolicyStore(nc, cfg.names)
        await store.start()
        deadline = time.monotonic() + 60
        while (role.store is None or role.fence is None) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # the watches are open
        # A KV key keeps its last ``store.history`` revisions: a watcher that falls further behind (a loaded CI
        # host) never sees the overwritten ones, by JetStream's design. Each bad value must reach the buffer to be
        # dead-lettered, so the writer keeps within half the history of what the buffer has read.
        for i, value in enumerate(bad):
            while i - role.counters.get("bad_nats_values", 0) >= store.history // 2:
                assert not task.done(), task
                await asyncio.sleep(0.01)
            await store.put(key, value)
        await store.put(key, good)
        deadline = time.monotonic() + 300
        while not adopted(role) and time.monotonic() < deadline:
            assert not task.done(), task
            await asyncio.sleep(0.5)
        assert adopted(role)
        letters = await wait_dead_letters(cfg, len(bad), 300, task,
                                          read=lambda: role.counters.get("bad_nats_values", 0))
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await nc.close()
    return role, letters


def trainer_test_helpers():
    """tests/integration/test_trainer_role.py as a module (its ``make_batch``)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "trainer_role_batches", Path(__file__).resolve().parents[1] / "integration" / "test_trainer_role.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    return helpers


def two_step_trainer(cfg, model_dir):
    """The run config for a trainer that stops after two steps and publishes versions as files."""
    cfg.model.path = str(model_dir)
    cfg.trainer.max_steps = 2
    cfg.trainer.checkpoint_every = 100
    cfg.weightsync.transport = "file"
    cfg.weightsync.ack_deadline_s = 2.0
    return cfg


async def wait_dead_letters(cfg, n: int, timeout_s: float, task: asyncio.Task, read=None) -> list:
    """The dead letters once there are ``n``; fails after ``timeout_s`` naming how many the role read (``read()``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if task.done():
            task.result()
            raise AssertionError("the role stopped")
        letters = await read_topic(cfg.kafka, cfg.names.dead_letter, expect=DeadLetter, idle_timeout_s=1)
        if len(letters) >= n:
            return letters
        await asyncio.sleep(2)
    seen = f" (the role read {read()} bad values)" if read is not None else ""
    raise AssertionError(f"only {len(letters)} of {n} dead letters after {timeout_s} s{seen}")


@pytest.mark.timeout(900)
async def test_buffer_survives_a_thousand_bad_episodes(run_config) -> None:
    from buffer.synthetic import make_group
    from streamforge.audit import run_audit
    from streamforge.roles import build_role

    cfg = with_section(run_config, "buffer", groups_per_batch=2, max_batch_wait_s=0.5, max_batches_ahead=0)  # no trainer
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
    role = build_role("buffer", role_cfg)
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
    assert audit["batched"] == len(good) and audit["dropped"]["malformed"] == N, audit
    assert_nothing_lost(audit, prompts="none")  # episodes fed straight to the topic: no prompt to account for


@pytest.mark.timeout(900)
async def test_trainer_survives_a_thousand_bad_batches(run_config, tmp_path) -> None:
    from consumers.ledger import Ledger
    from models.tiny_model import build_tiny_model
    from streamforge.roles import build_role

    make_batch = trainer_test_helpers().make_batch
    cfg = two_step_trainer(run_config, build_tiny_model(tmp_path / "tiny", seed=0))
    cfg.kafka.max_message_bytes = ROLE_MAX_BYTES
    good = [make_batch(i) for i in range(2)]
    bad = hostile(good[0], N, seed=2, nan_field="advantages")
    big = dataclasses.replace(cfg.kafka, max_message_bytes=16 * 1024 * 1024)
    async with Producer(big) as producer:
        futs = [await producer.enqueue_raw(cfg.names.batches, r, key="bad") for r in bad]
        await asyncio.gather(*futs)
        for b in good:
            await producer.send(cfg.names.batches, b, key=b.batch_id)
    role = build_role("trainer", cfg)
    await asyncio.wait_for(role.serve(), 600)
    assert role.finished_reason.startswith("max_steps")
    assert [r["batch_ids"] for r in Ledger.read(cfg.run_dir)] == [[b.batch_id] for b in good]
    letters = await read_topic(big, cfg.names.dead_letter, expect=DeadLetter)
    reasons = Counter(x.value.reason for x in letters)
    assert sum(reasons.values()) == N and all(x.value.source == cfg.names.batches for x in letters), reasons
    assert Batch  # the schema under test


@pytest.mark.vllm
@pytest.mark.timeout(900)
async def test_generator_survives_a_thousand_bad_prompts(run_config, tmp_path) -> None:
    """1,000 undecodable prompt records plus prompts that decode but no engine can take (empty, longer than
    max_model_len, token ids outside the vocabulary), around good ones, through a generator running real vLLM."""
    from models.tiny_model import build_tiny_model
    from producers.engine import Engine
    from producers.sources import toy_prompts
    from streamforge.audit import run_audit
    from streamforge.roles import build_role
    from topics.schemas import Episode, Prompt

    model = build_tiny_model(tmp_path / "tiny", seed=0)
    cfg = with_section(run_config, "generator", group_size=2, max_tokens=2, generator_id="fuzz",
                       max_policy_lag=1000, groups_per_step=0.0)  # no trainer: no quota
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model), max_seq_len=64))
    role_cfg = with_section(cfg, "kafka", max_message_bytes=ROLE_MAX_BYTES)
    good = [p for _, p in zip(range(4), toy_prompts("addmod10", seed=3))]
    bad = hostile(good[0], N, seed=3, nan_field="reward")
    rng = np.random.default_rng(3)
    unusable = []
    for i in range(100):
        unusable.append(Prompt(prompt_id=f"empty-{i}", text="", task="addmod10"))
        unusable.append(Prompt(prompt_id=f"long-{i}", text="1+2=" * 40, task="addmod10"))
        unusable.append(Prompt(prompt_id=f"vocab-{i}", text="", task="addmod10",
                               token_ids=rng.integers(64, 2**31 - 1, size=5, dtype=np.int32)))
    async with Producer(cfg.kafka) as producer:
        for p in good[:2]:
            await producer.send(cfg.names.prompts, p, key=p.prompt_id)
    await produce_raw(cfg, cfg.names.prompts, bad, "bad")
    async with Producer(cfg.kafka) as producer:
        for p in [*unusable, *good[2:]]:
            await producer.send(cfg.names.prompts, p, key=p.prompt_id)

    engine = Engine(str(model), max_model_len=64, seed=0)
    await engine.start()
    role = build_role("generator", role_cfg, engine=engine)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    try:
        letters = await wait_dead_letters(cfg, N + len(unusable), 600, task)
        deadline = time.monotonic() + 120
        while role.stats["episodes"] < 2 * len(good) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert role.stats["episodes"] == 2 * len(good) and not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await engine.stop()
    reasons = Counter(x.value.reason for x in letters)
    assert len(letters) == N + len(unusable) and all(x.value.source == cfg.names.prompts for x in letters), reasons
    assert set(reasons) <= {"malformed", "unknown_schema", "oversized", "invalid"}
    assert reasons["oversized"] > 0 and reasons["unknown_schema"] > 0 and reasons["invalid"] >= len(unusable)
    details = [x.value.detail for x in letters if x.value.reason == "invalid"]
    assert any("is empty" in d for d in details) and any("max_model_len 64" in d for d in details)
    assert any("outside the vocabulary" in d for d in details)
    episodes = await read_topic(cfg.kafka, cfg.names.episodes, expect=Episode)
    assert sorted({r.value.group_id for r in episodes}) == sorted(p.prompt_id for p in good)
    # every prompt record was consumed for good (drained and committed), each bad one dead-lettered at its place
    audit = await run_audit(cfg)
    prompts = assert_nothing_lost(audit)
    assert prompts["consumed"] == prompts["records"] == N + len(unusable) + len(good), prompts
    assert prompts["dead_lettered"] == N + len(unusable) and prompts["answered"] == len(good), prompts


@pytest.mark.timeout(900)
async def test_buffer_survives_a_thousand_bad_policy_values(run_config) -> None:
    """1,000 hostile values written to the NATS KV key the buffer watches for the latest PolicyVersion: each is
    dead-lettered (source ``kv:<bucket>/latest``) with its reason, the buffer keeps running and still follows a
    good version written after them."""
    from topics.schemas import PolicyVersion

    cfg = run_config
    good = PolicyVersion(version=3, step=3)
    bad = hostile(good, N, seed=4, nan_field="reward", max_bytes=codec.DEFAULT_MAX_BYTES)  # NATS caps size first
    role, letters = await kv_values_under_buffer(cfg, cfg.names.LATEST_KEY, bad, codec.encode(good),
                                                 lambda role: role.latest_version == 3)
    reasons = Counter(x.value.reason for x in letters)
    assert len(letters) == N and {x.value.source for x in letters} == {f"kv:{cfg.names.policy_bucket}/latest"}
    assert set(reasons) <= {"malformed", "unknown_schema", "oversized", "invalid"} and reasons["unknown_schema"] > 0
    assert role.counters["bad_nats_values"] == N


@pytest.mark.timeout(900)
async def test_trainer_survives_a_thousand_bad_membership_and_ack_messages(run_config, tmp_path) -> None:
    """1,000 hostile messages each on the membership and ack subjects of a running trainer's weight publisher:
    each is dead-lettered (source = the subject) with its reason, and the trainer then trains its batches."""
    from consumers.ledger import Ledger
    from models.tiny_model import build_tiny_model
    from streamforge.roles import build_role
    from topics.nats import connect
    from topics.schemas import Membership, VersionAck

    helpers = trainer_test_helpers()
    cfg = two_step_trainer(run_config, build_tiny_model(tmp_path / "tiny", seed=0))
    max_bytes = codec.DEFAULT_MAX_BYTES  # NATS caps the size (1 MiB) before the codec would
    bad_members = hostile(Membership(generator_id="g", event="join"), N, seed=5, nan_field="reward",
                          max_bytes=max_bytes)
    bad_acks = hostile(VersionAck(generator_id="g", version=1), N, seed=6, nan_field="reward", max_bytes=max_bytes)
    role = build_role("trainer", cfg)
    task = asyncio.create_task(role.serve())
    nc = await connect(cfg.nats, name="fuzz")
    try:
        deadline = time.monotonic() + 120
        while (role.publisher is None or not role.publisher._subs) and time.monotonic() < deadline:
            assert not task.done(), task
            await asyncio.sleep(0.2)
        for data in bad_members:
            await nc.publish(cfg.names.membership_subject, data)
        for data in bad_acks:
            await nc.publish(cfg.names.ack_subject, data)
        await nc.flush()
        letters = await wait_dead_letters(cfg, 2 * N, 600, task)
        async with Producer(cfg.kafka) as producer:
            for b in (helpers.make_batch(0), helpers.make_batch(1)):
                await producer.send(cfg.names.batches, b, key=b.batch_id)
        await asyncio.wait_for(task, 300)
    finally:
        await nc.close()
        if not task.done():
            task.cancel()
    assert role.finished_reason.startswith("max_steps") and len(Ledger.read(cfg.run_dir)) == 2
    by_source = Counter(x.value.source for x in letters)
    assert by_source == {cfg.names.membership_subject: N, cfg.names.ack_subject: N}, by_source
    reasons = Counter(x.value.reason for x in letters)
    assert set(reasons) <= {"malformed", "unknown_schema", "invalid"} and reasons["unknown_schema"] > 0, reasons
    assert role.publisher.counters["bad_messages"] == 2 * N


def hostile_fenced(n: int, seed: int) -> list[bytes]:
    """Fencing records (JSON ``{generator_id: {"last_acked_version": int}}``) that the buffer cannot read."""
    import orjson

    from weightsync.members import parse_fenced

    rng = random.Random(seed)
    good = orjson.dumps({"gen-1": {"last_acked_version": 4, "fenced_at": 1.0}})
    shapes = [b"[]", b'"x"', b"3", b'{"g": 3}', b'{"g": {}}', b'{"g": {"last_acked_version": "v"}}',
              b'{"g": {"last_acked_version": 1e400}}', b'{"g": {"last_acked_version": [1]}}', b"null"]
    out: list[bytes] = []
    attempts = 0
    while len(out) < n:
        kind, attempts = attempts % 4, attempts + 1
        if kind == 0:
            data = rng.randbytes(rng.randrange(1, 200))
        elif kind == 1:
            data = good[: rng.randrange(1, len(good))]
        elif kind == 2:
            raw = bytearray(good)
            raw[rng.randrange(len(raw))] = rng.randrange(256)
            data = bytes(raw)
        else:
            data = rng.choice(shapes) + b" " * rng.randrange(3)
        try:
            parse_fenced(data)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
            out.append(data)
    return out


@pytest.mark.timeout(900)
async def test_buffer_survives_a_thousand_bad_fencing_records(run_config) -> None:
    """1,000 unreadable values of the fencing key the buffer follows: each is dead-lettered (source
    ``kv:<bucket>/fenced``), the buffer keeps running and adopts the good record written after them."""
    import orjson

    from weightsync.members import FENCED_KEY

    cfg = run_config
    good = orjson.dumps({"gen-7": {"last_acked_version": 5}})
    role, letters = await kv_values_under_buffer(cfg, FENCED_KEY, hostile_fenced(N, seed=7), good,
                                                 lambda role: role.fence.fenced == {"gen-7": 5})
    assert len(letters) == N and {x.value.source for x in letters} == {f"kv:{cfg.names.policy_bucket}/fenced"}
    assert {x.value.reason for x in letters} == {"malformed"} and role.counters["bad_nats_values"] == N


@pytest.mark.timeout(900)
async def test_sft_trainer_survives_a_thousand_bad_examples(run_config, tmp_path) -> None:
    """The ``sft`` topic: 1,000 hostile records before the good examples of a trainer in SFT mode."""
    from consumers.ledger import Ledger
    from models.tiny_model import build_tiny_model
    from streamforge.roles import build_role
    from topics.schemas import SFTExample

    cfg = two_step_trainer(run_config, build_tiny_model(tmp_path / "tiny", seed=0))
    cfg.trainer.mode = "sft"
    cfg.trainer.sft_batch_size = 4
    cfg.nats.url = ""  # SFT without generators: nothing to publish
    cfg.kafka.max_message_bytes = ROLE_MAX_BYTES
    good = [SFTExample(example_id=f"ex{i}", prompt=f"{i % 4}+1=", completion=str(i % 4 + 1)) for i in range(8)]
    bad = hostile(good[0], N, seed=8, nan_field="reward")
    big = dataclasses.replace(cfg.kafka, max_message_bytes=16 * 1024 * 1024)
    async with Producer(big) as producer:
        futs = [await producer.enqueue_raw(cfg.names.sft, r, key="bad") for r in bad]
        await asyncio.gather(*futs)
        for ex in good:
            await producer.send(cfg.names.sft, ex, key=ex.example_id)
    role = build_role("trainer", cfg)
    await asyncio.wait_for(role.serve(), 600)
    assert role.finished_reason.startswith("max_steps") and len(Ledger.read(cfg.run_dir)) == 2
    letters = await read_topic(big, cfg.names.dead_letter, expect=DeadLetter)
    reasons = Counter(x.value.reason for x in letters)
    assert sum(reasons.values()) == N and all(x.value.source == cfg.names.sft for x in letters), reasons
    assert reasons["oversized"] > 0 and reasons["unknown_schema"] > 0
