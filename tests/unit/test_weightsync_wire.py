"""Bucket packing and the push header (weightsync/wire.py): exact round trips, alignment, malformed headers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from topics.errors import InvalidMessage
from weightsync.files import read_version, write_version
from weightsync.wire import ALIGN, Layout, Snapshot, pack, plan, unshared, view

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def _named(shapes, dtypes):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        t = torch.randn(shape, generator=g).to(dt) if dt.is_floating_point else torch.randint(0, 100, shape).to(dt)
        out.append((f"model.layers.{i}.w", t))
    return out


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=12),
    dtype_idx=st.lists(st.integers(0, len(DTYPES) - 1), min_size=12, max_size=12),
    bucket_bytes=st.integers(1, 600),
)
def test_pack_roundtrips_every_tensor_exactly(shapes, dtype_idx, bucket_bytes):
    named = _named([tuple(s) for s in shapes], [DTYPES[i] for i in dtype_idx])
    snap = pack(named, version=4, step=9, bucket_bytes=bucket_bytes)
    got = list(snap.tensors())
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    for slot in snap.layout.params:
        assert slot.offset % ALIGN == 0
        assert slot.offset + slot.nbytes <= snap.layout.buckets[slot.bucket]
    # a bucket only exceeds the limit when it holds a single (non-empty) tensor
    for b, size in enumerate(snap.layout.buckets):
        members = [p for p in snap.layout.params if p.bucket == b and p.nbytes]
        assert size <= max(bucket_bytes + ALIGN, ALIGN) or len(members) == 1


def test_snapshot_is_independent_of_the_source():
    w = torch.ones(4, 4)
    snap = pack([("w", w)], version=1, step=1, bucket_bytes=1 << 20)
    w.add_(1.0)  # the training step after the snapshot
    assert torch.equal(dict(snap.tensors())["w"], torch.ones(4, 4))


def test_header_roundtrip_and_receiver_views():
    named = _named([(3, 5), (7,), (2, 2, 2)], [torch.float32, torch.bfloat16, torch.int64])
    snap = pack(named, version=12, step=30, bucket_bytes=64)
    layout = Layout.from_header(snap.layout.to_header())
    assert layout == snap.layout
    # a receiver that got the raw buckets rebuilds the same tensors
    raw = [b.clone() for b in snap.buffers]
    rebuilt = Snapshot(layout=layout, buffers=raw)
    for (n, a), (m, b) in zip(named, rebuilt.tensors()):
        assert n == m and torch.equal(a, b)


@pytest.mark.parametrize("header", [
    b"not json",
    b'{"format": 2, "version": 1, "step": 0, "buckets": [], "params": []}',
    b'{"format": 1, "version": 1, "step": 0, "buckets": [8], "params": [["w", "float32", [4], 0, 0]]}',
    b'{"format": 1, "version": 1, "step": 0, "buckets": [64], "params": [["w", "complex7", [1], 0, 0]]}',
    b'{"format": 1, "version": 1, "step": 0, "buckets": [64], "params": [["w", "float32", [1], 3, 0]]}',
    b'{"format": 1, "version": 1}',
])
def test_malformed_headers_raise_typed_error(header):
    with pytest.raises(InvalidMessage):
        Layout.from_header(header)


def test_plan_packs_small_tensors_together_and_large_ones_alone():
    layout = plan([("a", torch.float32, (4,)), ("b", torch.float32, (4,)), ("big", torch.float32, (1000,)),
                   ("c", torch.float32, (4,))], version=0, step=0, bucket_bytes=256)
    assert [p.bucket for p in layout.params] == [0, 0, 1, 2]
    assert view(torch.zeros(layout.buckets[1], dtype=torch.uint8), layout.params[2]).shape == (1000,)


def test_file_version_roundtrip_and_pruning(tmp_path):
    named = _named([(3, 5), (7,)], [torch.float32, torch.bfloat16])
    for v in range(5):
        path = write_version(tmp_path, pack(named, version=v, step=v, bucket_bytes=1 << 20), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003", "v00000004"]
    loaded = read_version(path)
    for n, t in named:
        assert torch.equal(loaded[n], t)


def test_unshared_buffers_are_those_no_view_holds():
    snap = pack(_named_for_unshared(), version=1, step=1, bucket_bytes=1024)
    assert unshared(snap.buffers) == snap.buffers  # nothing else holds them: the next push may land there
    held = dict(snap.tensors())  # views, as a model that kept a received tensor would hold
    assert unshared(snap.buffers) == []
    del held
    assert unshared(snap.buffers) == snap.buffers
    assert unshared([snap.buffers[0][8:]]) == []  # a slice is never taken for a whole buffer
    assert unshared([]) == []


def _named_for_unshared() -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.arange(300, dtype=torch.float32)), ("b", torch.ones(40, 3, dtype=torch.bfloat16))]


def test_pack_casts_floating_tensors_to_the_push_dtype():
    """``pack(dtype=bfloat16)``: each floating-point tensor arrives as ``t.to(bfloat16)`` would make it (round to
    nearest even, as the engine's own cast of a float32 push), integer ones as they are, in half the bytes."""
    named = _named([(64, 33), (7,), (5, 3)], [torch.float32, torch.int64, torch.float16])
    full = pack(named, version=1, step=1, bucket_bytes=1 << 20)
    half = pack(named, version=1, step=1, bucket_bytes=1 << 20, dtype=torch.bfloat16)
    got = dict(half.tensors())
    assert got["model.layers.0.w"].dtype == torch.bfloat16
    assert torch.equal(got["model.layers.0.w"], named[0][1].to(torch.bfloat16))
    assert torch.equal(got["model.layers.1.w"], named[1][1])  # int64 untouched
    assert torch.equal(got["model.layers.2.w"], named[2][1].to(torch.bfloat16))
    assert [p.dtype for p in Layout.from_header(half.layout.to_header()).params] == ["bfloat16", "int64", "bfloat16"]
    assert half.nbytes < full.nbytes * 0.55
