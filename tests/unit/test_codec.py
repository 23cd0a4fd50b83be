"""The codec: every schema round-trips; hostile bytes always give a typed CodecError; the format is plain msgpack."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

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
        kwargs["env_restarts"] = draw(st.integers(0, 2**31))  # validate(): counts
        kwargs["tool_calls"] = draw(st.integers(0, 2**31))
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
        for name, dtype in (("episode_partitions", np.int32), ("episode_offsets", np.int64)):  # [B] or empty
            kwargs[name] = np.arange(draw(st.sampled_from([0, b])), dtype=dtype)
    if cls is schemas.ServiceBeat:  # validate(): a capacity, a load, a positive health timeout
        kwargs.update(capacity=draw(st.integers(1, 2**31)), load=draw(st.integers(0, 2**31)),
                      health_timeout_s=draw(st.floats(0.5, 1e6, width=32)))
    if cls is schemas.RewardRequest:  # validate(): columns of one length
        for name in ("prompt_ids", "tasks", "prompt_texts", "answers", "responses"):
            kwargs[name] = draw(st.lists(TEXT, min_size=n, max_size=n))
    if cls is schemas.RewardReply:  # validate(): one error string per score
        kwargs["errors"] = draw(st.lists(TEXT, min_size=n, max_size=n))
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
    wire = codec.encode(msg)
    out = codec.decode(wire)
    assert type(out) is cls
    assert _equal(msg, out)
    assert codec._canonical_message(wire) is not None  # the encoder's own layout takes the fast path...
    assert _equal(codec._decode_generic(wire), out)  # ...which decodes exactly what the generic path does
    # Another msgpack layout of the same map (here: keys in schema order, minimal ints and bins; its head is still
    # the canonical one, so the typed decode reads it too) decodes the same, by either path.
    other = msgpack.packb(codec.to_wire(msg), use_bin_type=True)
    assert _equal(codec.decode(other), out) and _equal(codec._decode_generic(other), out)


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
    assert obj["schema"] == "episode" and obj["v"] == 3
    assert obj["episode_id"] == "g/0" and obj["reward"] == 1.0
    t = obj["logprobs"]
    assert t["dtype"] == "float32" and t["shape"] == [3]
    assert np.frombuffer(t["data"], dtype="<f4").tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert np.frombuffer(obj["token_versions"]["data"], dtype="<i4").tolist() == [3, 3, 4]


def test_a_version_1_episode_decodes_as_a_single_turn_episode() -> None:
    """A record written before the multi-turn fields: every response token is the model's, turn 0."""
    obj = msgpack.unpackb(codec.encode(_episode()), raw=False)
    obj["v"] = 1
    for name in ("token_mask", "turn_ids", "env_name", "env_replica", "turn_rewards", "final_reward",
                 "env_restarts", "tool_calls", "prompt_partition", "prompt_offset"):
        del obj[name]
    ep = codec.decode(msgpack.packb(obj, use_bin_type=True))
    assert ep.model_mask.tolist() == [1, 1, 1] and ep.turns == 1 and ep.env_name == "" and ep.min_version == 3


def test_a_version_2_episode_decodes_without_its_prompts_place() -> None:
    """A record written before ``prompt_partition``/``prompt_offset``: both -1 (the audit matches it by prompt id)."""
    obj = msgpack.unpackb(codec.encode(_episode(prompt_partition=2, prompt_offset=7)), raw=False)
    assert (obj["prompt_partition"], obj["prompt_offset"]) == (2, 7)
    obj["v"] = 2
    del obj["prompt_partition"], obj["prompt_offset"]
    ep = codec.decode(msgpack.packb(obj, use_bin_type=True))
    assert (ep.prompt_partition, ep.prompt_offset) == (-1, -1) and ep.episode_id == "g/0"
    assert ep.logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3])


def test_decoded_tensors_are_views_of_the_message_bytes() -> None:
    out = codec.decode(codec.encode(_episode()))
    assert not out.logprobs.flags.owndata and not out.logprobs.flags.writeable


def test_a_decoded_message_adds_one_object_for_the_cycle_collector() -> None:
    """Tensors keep their bytes alive through untracked objects (not a memoryview and its managed buffer each):
    a buffer holding thousands of episodes would otherwise make the collector's passes a third of its CPU."""
    import gc

    data = [codec.encode(_episode(episode_id=f"g/{i}")) for i in range(200)]
    gc.collect()
    before = len(gc.get_objects())
    kept = [codec.decode(d) for d in data]
    gc.collect()
    assert (len(gc.get_objects()) - before) / len(kept) <= 1.05
    assert all(np.shares_memory(k.logprobs, np.frombuffer(d, np.uint8)) for k, d in zip(kept, data))


@pytest.mark.parametrize("width", ["bin8", "bin16", "bin32", "str", "array", "bin32-short", "bin32-long"])
def test_tensor_bytes_of_any_bin_width_read_alike_and_other_types_go_to_the_generic_path(width: str) -> None:
    """The fast path reads a tensor's ``data`` as its encoded value and checks it is one bin itself."""
    ep = _episode()
    data = codec.encode(ep)
    payload = ep.logprobs.astype("<f4").tobytes()  # 12 bytes
    canonical = b"\xc6" + len(payload).to_bytes(4, "big") + payload
    assert data.count(canonical) == 1
    other = {"bin8": b"\xc4\x0c" + payload, "bin16": b"\xc5\x00\x0c" + payload, "bin32": canonical,
             "str": b"\xac" + payload, "array": msgpack.packb(list(payload)),
             "bin32-short": b"\xc6\x00\x00\x00\x08" + payload[:8], "bin32-long": b"\xc6\x00\x00\x00\x10" + payload + bytes(4)}
    mutated = data.replace(canonical, other[width])
    fast = codec._canonical_message(mutated)
    if width.startswith("bin") and "-" not in width:
        assert fast is not None and fast.logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3])
        assert _equal(codec.decode(mutated), codec.decode(data))
    else:
        assert fast is None  # the generic path gives the verdict
        with pytest.raises(CodecError):
            codec.decode(mutated)


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


def test_non_finite_turn_rewards_are_invalid_and_empty_ones_valid() -> None:
    """A single-turn episode (no turn rewards) skips the check; a multi-turn one with an inf reward is refused on
    both sides of the wire."""
    assert codec.decode(codec.encode(_episode())).turn_rewards.size == 0
    bad = _episode(turn_rewards=np.array([0.5, np.inf], dtype=np.float32))
    with pytest.raises(InvalidMessage, match="not finite"):
        codec.encode(bad)
    obj = msgpack.unpackb(codec.encode(_episode(turn_rewards=np.array([0.5, 1.0], dtype=np.float32))), raw=False)
    obj["turn_rewards"]["data"] = np.array([0.5, np.nan], dtype="<f4").tobytes()
    with pytest.raises(InvalidMessage, match="not finite"):
        codec.decode(msgpack.packb(obj, use_bin_type=True))


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


def test_canonical_layout_is_the_documented_map() -> None:
    """schema and v first, then the tensor fields in schema order, then the plain fields; dims uint32, data bin32."""
    data = codec.encode(_episode())
    obj = msgpack.unpackb(data, raw=False)
    specs = codec._SPECS[schemas.Episode]
    tensors = [s.name for s in specs if s.kind == "tensor"]
    assert list(obj) == ["schema", "v", *tensors, *(s.name for s in specs if s.kind != "tensor")]
    for name in tensors:
        assert list(obj[name]) == ["dtype", "shape", "data"]
    assert b"\xa5shape\x91\xce\x00\x00\x00\x03\xa4data\xc6\x00\x00\x00\x0c" in data  # logprobs: 3 float32


def test_decoded_message_holds_no_view_of_a_mutable_input() -> None:
    data = bytearray(codec.encode(_episode()))
    for raw in (data, memoryview(data)):
        out = codec.decode(raw)
        before = out.logprobs.copy()
        data[:] = bytes(len(data))  # the caller reuses its buffer
        assert np.array_equal(out.logprobs, before) and not out.logprobs.flags.writeable
        data[:] = codec.encode(_episode())


def test_arrays_of_another_dtype_order_or_type_are_converted_on_encode() -> None:
    ep = _episode(logprobs=np.array([-0.1, -0.2, -0.3], dtype=np.float64),
                  response_tokens=np.array([[7, 0], [8, 0], [9, 0]], dtype=np.int64)[:, 0],  # not contiguous
                  token_versions=[3, 3, 4], prompt_tokens=np.arange(5, dtype=">i4"))
    out = codec.decode(codec.encode(ep))
    assert out.logprobs.dtype == np.float32 and out.logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert out.response_tokens.dtype == np.int32 and out.response_tokens.tolist() == [7, 8, 9]
    assert out.token_versions.tolist() == [3, 3, 4] and out.prompt_tokens.tolist() == list(range(5))
    with pytest.raises(InvalidMessage):
        codec.encode(_episode(logprobs=np.zeros((3, 1), dtype=np.float32)))
    with pytest.raises(InvalidMessage):
        codec.encode(_episode(reward_components={"toy": object()}))


def _with_extra_entry(data: bytes, key: str, value: object) -> bytes:
    """The canonical message with one more map entry at its end (the map header counts it)."""
    assert data[0] == 0xDE  # an Episode has 21 entries: a map16 header
    count = int.from_bytes(data[1:3], "big") + 1
    return b"\xde" + count.to_bytes(2, "big") + data[3:] + msgpack.packb(key) + msgpack.packb(value, use_bin_type=True)


def test_duplicate_and_unknown_keys_decode_as_a_plain_msgpack_reader_sees_them() -> None:
    """A key given twice: the last one wins, as in ``msgpack.unpackb``; an unknown key is ignored."""
    data = codec.encode(_episode())
    twice = _with_extra_entry(data, "logprobs", {"dtype": "float32", "shape": [3], "data": bytes(12)})
    assert codec._canonical_message(twice) is None
    assert codec.decode(twice).logprobs.tolist() == [0.0, 0.0, 0.0]
    # a schema given twice, and the last one is not an Episode (nor a version of Prompt that exists)
    with pytest.raises((InvalidMessage, UnknownSchema)):
        codec.decode(_with_extra_entry(data, "schema", "prompt"), expect=schemas.Episode)
    unknown = _with_extra_entry(data, "added_later", [1, 2])
    assert _equal(codec.decode(unknown), _episode(created_at=codec.decode(data).created_at))


@pytest.mark.parametrize("msg, expected", [
    (_episode(reward=1, reward_components={"toy": 1}), {"reward": 1.0, "reward_components": {"toy": 1.0}}),
    (_episode(timings={"queued_s": 2}), {"timings": {"queued_s": 2.0}}),
    (_episode(reward_components={b"toy": 1.0}), MalformedMessage),
    (_episode(timings={"queued_s": "soon"}), MalformedMessage),
    (_episode(group_size=True), MalformedMessage),
    (_episode(task=b"addmod10"), MalformedMessage),
    (schemas.DropRecord(episode_ids=["g/0", 3], reason="stale"), MalformedMessage),
    (schemas.Prompt(prompt_id="p", task="t", metadata={b"k": 1}), MalformedMessage),
    (schemas.DeadLetter(source="s", reason="r", value="text, not bytes"), MalformedMessage),
], ids=range(9))
def test_plain_values_of_another_type_get_the_generic_checks(msg: object, expected: object) -> None:
    """Written in the canonical layout but not of the field's exact type: the generic path converts (an int for a
    float) or rejects, exactly as it does for any other layout, and the fast path either declines or (an int for a
    float) converts alike."""
    data = codec.encode(msg)
    fast = codec._canonical_message(data)
    assert fast is None or isinstance(expected, dict) and _equal(fast, codec._decode_generic(data))
    if isinstance(expected, dict):
        out = codec.decode(data)
        for name, value in expected.items():
            assert getattr(out, name) == value and repr(getattr(out, name)) == repr(value)
    else:
        with pytest.raises(expected):
            codec.decode(data)


class _EncodesWhileIterated(dict):
    """A dict whose ``items`` (msgpack calls it for a dict subclass) encodes another message on the same thread."""

    def items(self) -> object:
        codec.encode(_episode(episode_id="nested"))
        return super().items()


def test_encode_is_reentrant_and_thread_safe() -> None:
    """Each thread reuses one msgpack packer, but a nested or concurrent encode never shares it."""
    plain = codec.encode(_episode(created_at=1.0))
    assert codec.encode(_episode(created_at=1.0, reward_components=_EncodesWhileIterated(toy=1.0))) == plain
    eps = [_episode(episode_id=f"g/{i}", created_at=1.0, response_tokens=np.arange(i, dtype=np.int32),
                    logprobs=np.zeros(i, np.float32), token_versions=np.zeros(i, np.int32)) for i in range(64)]
    expected = [codec.encode(ep) for ep in eps]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            assert list(pool.map(codec.encode, eps)) == expected


def test_a_version_1_batch_decodes_without_the_episode_offsets() -> None:
    """Batch v2 added ``episode_partitions`` and ``episode_offsets``; a v1 record still on a topic decodes."""
    batch = schemas.Batch(batch_id="b", episode_ids=["a", "b"], group_ids=["g", "g"],
                          input_ids=np.zeros((2, 3), np.int32), loss_mask=np.ones((2, 3), np.uint8),
                          old_logprobs=np.zeros((2, 3), np.float32), token_versions=np.zeros((2, 3), np.int32),
                          advantages=np.array([1, -1], np.float32), rewards=np.array([1, 0], np.float32),
                          prompt_lens=np.array([1, 1], np.int32), seq_lens=np.array([3, 3], np.int32),
                          episode_partitions=np.array([0, 0], np.int32), episode_offsets=np.array([7, 9], np.int64))
    assert codec.decode(codec.encode(batch)).episode_offsets.tolist() == [7, 9]
    old = codec.to_wire(batch)
    old["v"] = 1
    del old["episode_partitions"], old["episode_offsets"]
    out = codec.decode(msgpack.packb(old, use_bin_type=True), expect=schemas.Batch)
    assert type(out) is schemas.Batch and out.episode_offsets.size == 0 and out.episode_partitions.size == 0
    assert out.batch_id == "b" and out.input_ids.shape == (2, 3)


def test_a_version_1_trainer_progress_decodes_with_its_groups_not_reported() -> None:
    """TrainerProgress v2 added ``groups`` (what the generators' quota counts); a v1 record in the KV store decodes
    with ``groups`` -1, which the generators read as "count in steps"."""
    progress = schemas.TrainerProgress(step=7, version=3, groups=25)
    assert codec.decode(codec.encode(progress)).groups == 25
    old = codec.to_wire(progress)
    old["v"] = 1
    del old["groups"]
    out = codec.decode(msgpack.packb(old, use_bin_type=True), expect=schemas.TrainerProgress)
    assert type(out) is schemas.TrainerProgress and out.groups == -1 and out.step == 7
