"""Hostile input for every schema that crosses a topic or subject: 10,000 messages of each kind of bad input.

Kinds: random bytes, truncated valid messages, byte-mutated valid messages, wrong schema versions, oversized
payloads, wrong tensor shapes or dtypes, NaN rewards. Every one must either decode into a valid message or raise a
``CodecError`` with a dead-letter ``reason``; nothing else may escape (the role's reader survives any input).
"""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from topics import codec, schemas
from topics.errors import CodecError, MalformedMessage

N = 10_000
REASONS = {"malformed", "unknown_schema", "oversized", "invalid"}


def valid_messages() -> list[object]:
    n = 5
    arr = lambda dt: np.arange(n, dtype=dt)
    return [
        schemas.Prompt(prompt_id="p", task="addmod10", text="1+2=", token_ids=arr("int32"), answer="3"),
        schemas.Episode(episode_id="g/0", group_id="g", group_size=8, prompt_id="p", prompt_tokens=arr("int32"),
                        response_tokens=arr("int32"), logprobs=arr("float32"), token_versions=arr("int32"),
                        reward=1.0, reward_components={"toy": 1.0}),
        schemas.Batch(batch_id="b", episode_ids=["a", "b"], group_ids=["g", "g"],
                      input_ids=np.zeros((2, n), np.int32), loss_mask=np.ones((2, n), np.uint8),
                      old_logprobs=np.zeros((2, n), np.float32), token_versions=np.zeros((2, n), np.int32),
                      advantages=np.array([1, -1], np.float32), rewards=np.array([1, 0], np.float32),
                      prompt_lens=np.array([2, 2], np.int32), seq_lens=np.array([n, n], np.int32)),
        schemas.PolicyVersion(version=3, step=3, transport="gloo", address="127.0.0.1:1", batch_ids=["b"]),
        schemas.VersionAck(generator_id="g0", version=3, pause_ms=1.5),
        schemas.Membership(generator_id="g0", event="join"),
        schemas.SFTExample(example_id="e", prompt="q", completion="a"),
        schemas.DropRecord(episode_ids=["g/0"], reason="stale"),
        schemas.DeadLetter(source="sf.episodes", reason="malformed", value=b"\x00\x01"),
    ]


def check(data: bytes, *, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> str:
    try:
        msg = codec.decode(data, max_bytes=max_bytes)
    except CodecError as exc:
        assert exc.reason in REASONS and exc.retriable is False
        return exc.reason
    assert type(msg) in schemas.ALL_SCHEMAS
    return "ok"


def tensor_fields(msg: object) -> list[str]:
    return [s.name for s in codec._SPECS[type(msg)] if s.kind == "tensor"]


@pytest.mark.parametrize("msg", valid_messages(), ids=lambda m: m.SCHEMA)
def test_ten_thousand_of_each_kind_of_bad_input(msg: object) -> None:
    rng = random.Random(hash(type(msg).SCHEMA) % 2**32)
    good = codec.encode(msg)
    obj = msgpack.unpackb(good, raw=False)
    seen: dict[str, set[str]] = {}

    def record(kind: str, outcome: str) -> None:
        seen.setdefault(kind, set()).add(outcome)

    for _ in range(N):  # random bytes
        record("random", check(rng.randbytes(rng.randrange(0, 200))))
    for _ in range(N):  # truncated valid messages
        record("truncated", check(good[: rng.randrange(0, len(good))]))
    for _ in range(N):  # byte-mutated valid messages
        raw = bytearray(good)
        for _ in range(rng.randrange(1, 5)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        record("mutated", check(bytes(raw)))
    for _ in range(N):  # wrong schema names or versions
        bad = dict(obj, v=rng.choice([0, type(msg).VERSION + 1, 99, -1, "1", None, 1.0]))  # no version it reads
        if rng.random() < 0.3:
            bad["schema"] = rng.choice(["Episode", "", "batchx", 7])
        record("version", check(msgpack.packb(bad, use_bin_type=True)))
    limit = len(good) - 1
    for _ in range(N):  # oversized against the reader's limit
        record("oversized", check(good + rng.randbytes(rng.randrange(0, 8)), max_bytes=limit))
    fields = tensor_fields(msg)
    for _ in range(N if fields else 0):  # wrong tensor shapes or dtypes
        bad = dict(obj)
        name = rng.choice(fields)
        t = dict(bad[name])
        choice = rng.randrange(4)
        if choice == 0:
            t["dtype"] = rng.choice(["float64", "int8", "complex64", "object", "bool", 3])
        elif choice == 1:
            t["shape"] = rng.choice([[], [1, 2, 3], [-1], [2**40], ["5"], None])
        elif choice == 2:
            data = t["data"]  # a length that no longer fills the shape
            t["data"] = data[: rng.randrange(len(data))] if data and rng.random() < 0.5 else data + rng.randbytes(
                rng.randrange(1, 4))
        else:
            t = rng.choice([None, 5, "tensor", [1, 2], {"dtype": "int32"}])
        bad[name] = t
        record("tensor", check(msgpack.packb(bad, use_bin_type=True)))
    if isinstance(msg, schemas.Episode):
        for _ in range(N):  # NaN / infinite rewards
            bad = dict(obj, reward=rng.choice([float("nan"), float("inf"), float("-inf")]))
            record("nan", check(msgpack.packb(bad, use_bin_type=True)))
        assert seen["nan"] == {"invalid"}
    assert seen["version"] == {"unknown_schema"}
    assert seen["oversized"] == {"oversized"}
    assert "ok" not in seen.get("tensor", set())
    assert seen["truncated"] <= REASONS  # a strict prefix of a msgpack map is never a whole message


def _outcome(fn: object) -> object:
    try:
        return fn()  # type: ignore[operator]
    except CodecError as exc:
        return type(exc)
    except Exception:  # noqa: BLE001 -- decode() turns these into MalformedMessage
        return MalformedMessage


def _same(a: object, b: object) -> bool:
    """Field by field; arrays by dtype, shape and bytes, other values by repr (so NaN equals NaN)."""
    for spec in codec._SPECS[type(a)]:
        x, y = getattr(a, spec.name), getattr(b, spec.name)
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return False
        elif type(x) is not type(y) or repr(x) != repr(y):
            return False
    return True


@pytest.mark.parametrize("msg", valid_messages(), ids=lambda m: m.SCHEMA)
def test_fast_path_accepts_only_what_the_generic_path_decodes_the_same(msg: object) -> None:
    """Mutated encoder output: where the canonical parser accepts the bytes, the generic path (``msgpack.unpackb``
    and ``from_wire``) must decode the same message, or raise the same error from ``validate``."""
    rng = random.Random(hash(type(msg).SCHEMA) % 2**32 + 1)
    good = codec.encode(msg)
    accepted = 0
    for _ in range(N // 2):
        raw = bytearray(good)
        for _ in range(rng.randrange(1, 3)):
            pos = rng.randrange(len(raw))
            op = rng.randrange(4)
            if op < 2:
                raw[pos] = rng.randrange(256)
            elif op == 2:
                raw[pos:pos] = rng.randbytes(rng.randrange(1, 4))
            else:
                del raw[pos:pos + rng.randrange(1, 4)]
        raw = bytes(raw)
        out = codec._canonical_message(raw)
        if out is None:
            continue
        accepted += 1

        def build(out: object = out) -> object:
            validate = getattr(out, "validate", None)
            if validate is not None:
                validate()
            return out

        fast, generic = _outcome(build), _outcome(lambda raw=raw: codec._decode_generic(raw))
        if isinstance(generic, type):
            assert fast is generic, (raw, fast, generic)
        else:
            assert not isinstance(fast, type) and _same(fast, generic), (raw, fast, generic)
        check(raw)  # and decode() itself gives a valid message or a typed error
    assert accepted > 0  # mutations inside texts or tensor bytes keep a canonical message
