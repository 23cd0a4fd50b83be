"""The codec: every schema round-trips; hostile bytes always give a typed CodecError; the format is plain msgpack."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topics import codec, schemas
from topics.errors import CodecError, InvalidMessage, MalformedMessage, MessageTooLarge, UnknownSchema

TEXT = st.text(max_size=20)
FLOAT = st.floats(allow_nan=False, allow_infinity=False, width=32)


def _value_strategy(spec: codec._FieldSpec, n: int) -> st.SearchStrategy:
    if spec.kind == "tensor":
        shape = (n,) if spec.ndim == 1 else (2, n)
        if spec.dtype.startswith("float"):
            elems = st.floats(-100, 100, width=32)
        elif spec.dtype == "uint8":
            elems = st.integers(0, 1)
        else:
            elems = st.integers(-(2**31), 2**31 - 1)
        return st.lists(elems, min_size=math.prod(shape), max_size=math.prod(shape)).map(
            lambda v: np.array(v, dtype=spec.dtype).reshape(shape))
    return {
        "str": TEXT, "int": st.integers(-(2**40), 2**40), "float": FLOAT, "bool": st.booleans(),
        "bytes": st.binary(max_size=32), "dict_float": st.dictionaries(TEXT, FLOAT, max_size=3),
        "dict_any": st.dictionaries(TEXT, st.one_of(st.integers(-9, 9), TEXT, st.booleans()), max_size=3),
        "list_str": st.lists(TEXT, max_size=3),
    }[spec.kind]


@st.composite
def messages(draw: st.DrawFn, cls: type) -> object:
    n = draw(st.integers(0, 6))
    kwargs = {spec.name: draw(_value_strategy(spec, n)) for spec in codec._SPECS[cls]}
    if cls is schemas.Episode:
        kwargs["group_size"] = draw(st.integers(1, 64))
    if cls is schemas.Batch:
        b = 2
        kwargs["episode_ids"] = ["a", "b"]
        for name in ("advantages", "rewards"):
            kwargs[name] = np.asarray(draw(st.lists(st.floats(-5, 5, width=32), min_size=b, max_size=b)),
                                      dtype=np.float32)
        for name in ("prompt_lens", "seq_lens"):
            kwargs[name] = np.zeros(b, dtype=np.int32)
        for name in ("segment_ids", "position_ids"):  # the padded layout (packed batches: test_buffer_packing)
            kwargs[name] = np.zeros((0, 0), dtype=np.int32)
    return cls(**kwargs)


def _equal(a: object, b: object) -> bool:
    for spec in codec._SPECS[type(a)]:
        x, y = getattr(a, spec.name), getattr(b, spec.name)
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("cls", schemas.ALL_SCHEMAS, ids=lambda c: c.SCHEMA)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_every_schema(cls: type, data: st.DataObject) -> None:
    msg = data.draw(messages(cls))
    out = codec.decode(codec.encode(msg))
    assert type(out) is cls
    assert _equal(msg, out)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_give_typed_errors(raw: bytes) -> None:
    try:
        codec.decode(raw)
    except CodecError as exc:
        assert exc.retriable is False
        assert exc.reason in ("malformed", "unknown_schema", "oversized", "invalid")


def _episode(**kw: object) -> schemas.Episode:
    base = dict(episode_id="g/0", group_id="g", group_size=4, prompt_id="p", task="addmod10",
                prompt_tokens=np.arange(5, dtype=np.int32), response_tokens=np.array([7, 8, 9], dtype=np.int32),
                logprobs=np.array([-0.1, -0.2, -0.3], dtype=np.float32),
                token_versions=np.array([3, 3, 4], dtype=np.int32), policy_version=3, reward=1.0,
                reward_components={"toy": 1.0}, finish_reason="stop", generator_id="gen-0")
    base.update(kw)
    return schemas.Episode(**base)


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_mutated_valid_messages_give_typed_errors_or_valid_messages(data: st.DataObject) -> None:
    raw = bytearray(codec.encode(_episode()))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif op == "truncate":
            del raw[pos:]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
    try:
        out = codec.decode(bytes(raw))
    except CodecError:
        return
    assert type(out) in schemas.ALL_SCHEMAS  # a mutation that still decodes must still be a valid message


def test_plain_msgpack_reader_can_read_an_episode() -> None:
    """The documented layout: a map with schema/v and tensors as {dtype, shape, data} little-endian bytes."""
    ep = _episode()
    obj = msgpack.unpackb(codec.encode(ep), raw=False)
    assert obj["schema"] == "episode" and obj["v"] == 1
    assert obj["episode_id"] == "g/0" and obj["reward"] == 1.0
    t = obj["logprobs"]
    assert t["dtype"] == "float32" and t["shape"] == [3]
    assert np.frombuffer(t["data"], dtype="<f4").tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert np.frombuffer(obj["token_versions"]["data"], dtype="<i4").tolist() == [3, 3, 4]


def test_decoded_tensors_are_views_of_the_message_bytes() -> None:
    out = codec.decode(codec.encode(_episode()))
    assert not out.logprobs.flags.owndata and not out.logprobs.flags.writeable


def test_unknown_schema_version_is_a_typed_error() -> None:
    obj = msgpack.unpackb(codec.encode(_episode()), raw=False)
    obj["v"] = 99
    with pytest.raises(UnknownSchema) as err:
        codec.decode(msgpack.packb(obj, use_bin_type=True))
    assert err.value.version == 99 and err.value.reason == "unknown_schema"


def test_oversized_message_is_rejected_on_both_sides() -> None:
    ep = _episode()
    data = codec.encode(ep)
    with pytest.raises(MessageTooLarge):
        codec.decode(data, max_bytes=len(data) - 1)
    with pytest.raises(MessageTooLarge):
        codec.encode(ep, max_bytes=len(data) - 1)


def test_nan_reward_and_mismatched_lengths_are_invalid() -> None:
    with pytest.raises(InvalidMessage):
        codec.encode(_episode(reward=float("nan")))
    obj = msgpack.unpackb(codec.encode(_episode()), raw=False)
    obj["reward"] = float("nan")
    with pytest.raises(InvalidMessage):
        codec.decode(msgpack.packb(obj, use_bin_type=True))
    with pytest.raises(InvalidMessage):
        codec.encode(_episode(logprobs=np.zeros(2, dtype=np.float32)))


def test_wrong_tensor_dtype_or_shape_is_rejected() -> None:
    obj = msgpack.unpackb(codec.encode(_episode()), raw=False)
    obj["logprobs"]["dtype"] = "float64"
    with pytest.raises(InvalidMessage):
        codec.decode(msgpack.packb(obj, use_bin_type=True))
    obj = msgpack.unpackb(codec.encode(_episode()), raw=False)
    obj["logprobs"]["shape"] = [4]
    with pytest.raises(MalformedMessage):
        codec.decode(msgpack.packb(obj, use_bin_type=True))
    obj = msgpack.unpackb(codec.encode(_episode()), raw=False)
    obj["logprobs"]["shape"] = [3, 1]
    with pytest.raises(InvalidMessage):
        codec.decode(msgpack.packb(obj, use_bin_type=True))


def test_expect_restricts_the_schema() -> None:
    data = codec.encode(schemas.Prompt(prompt_id="p", task="t"))
    with pytest.raises(InvalidMessage):
        codec.decode(data, expect=schemas.Episode)
    assert codec.decode(data, expect=schemas.Prompt).prompt_id == "p"


def test_missing_required_field_and_wrong_field_type() -> None:
    obj = msgpack.unpackb(codec.encode(_episode()), raw=False)
    del obj["group_id"]
    with pytest.raises(MalformedMessage):
        codec.decode(msgpack.packb(obj, use_bin_type=True))
    obj = msgpack.unpackb(codec.encode(_episode()), raw=False)
    obj["group_size"] = "four"
    with pytest.raises(MalformedMessage):
        codec.decode(msgpack.packb(obj, use_bin_type=True))


def test_batch_validation_rejects_inconsistent_shapes() -> None:
    b, t = 2, 5
    batch = schemas.Batch(
        batch_id="x", episode_ids=["a", "b"], group_ids=["g", "g"],
        input_ids=np.zeros((b, t), np.int32), loss_mask=np.zeros((b, t), np.uint8),
        old_logprobs=np.zeros((b, t), np.float32), token_versions=np.zeros((b, t), np.int32),
        advantages=np.zeros(b, np.float32), rewards=np.zeros(b, np.float32),
        prompt_lens=np.zeros(b, np.int32), seq_lens=np.zeros(b, np.int32),
    )
    assert codec.decode(codec.encode(batch)).batch_id == "x"
    batch.old_logprobs = np.zeros((b, t + 1), np.float32)
    with pytest.raises(InvalidMessage):
        codec.encode(batch)
