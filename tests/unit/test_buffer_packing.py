"""Packed batches (``buffer.batching: pack``): row placement, the Batch layout and its validation, the wire, the
trainer's view (``batch_inputs``) and the state machine's choice of layout. No broker, no model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from buffer.config import BufferConfig
from buffer.policies import build_batch, pack_rows, score_group
from buffer.state import BufferState
from buffer.synthetic import make_group
from consumers.step import batch_inputs, trim_width
from topics import codec
from topics.errors import ConfigError, InvalidMessage
from topics.schemas import Batch


def groups(*shapes: tuple[int, int]):
    """One scored group of 2 episodes per (prompt_len, response_len)."""
    out = []
    for i, (p, r) in enumerate(shapes):
        eps = make_group(f"g{i}", 2, prompt_len=p, response_len=r, version=i, rewards=[0.0, 1.0])
        out.append(score_group(f"g{i}", eps, latest_version=None, max_policy_lag=9).kept)
    return out


def test_pack_rows_first_fit_longest_first_deterministic():
    assert pack_rows([5, 3, 8, 2, 4], 10) == [[2, 3], [0, 4], [1]]
    assert pack_rows([4, 4, 4], 8) == [[0, 1], [2]]  # ties in batch order
    assert pack_rows([12, 3], 10) == [[0], [1]]  # too long for a row: a row of its own


def test_packed_batch_holds_the_padded_batch_token_for_token():
    gs = groups((4, 6), (3, 2), (5, 9))
    padded = build_batch(gs, created_at=1.0)
    packed = build_batch(gs, created_at=1.0, pack_row_tokens=16)
    assert packed.packed and not padded.packed
    assert packed.batch_id == padded.batch_id and packed.episode_ids == padded.episode_ids
    assert packed.group_ids == padded.group_ids and len(packed.group_ids) == 6
    for name in ("advantages", "rewards", "prompt_lens", "seq_lens"):
        assert np.array_equal(getattr(packed, name), getattr(padded, name))
    assert packed.input_ids.shape[1] == 16 and packed.input_ids.shape[0] < padded.input_ids.shape[0]
    assert packed.stats["padding_fraction"] < padded.stats["padding_fraction"]
    packed.validate()
    for e in range(len(packed.episode_ids)):  # each episode: one contiguous run, positions 0.., same tokens
        rows, cols = np.nonzero(packed.segment_ids == e)
        n = int(padded.seq_lens[e])
        assert len(set(rows)) == 1 and list(cols) == list(range(cols[0], cols[0] + n))
        r = rows[0]
        assert list(packed.position_ids[r, cols]) == list(range(n))
        for name in ("input_ids", "loss_mask", "old_logprobs", "token_versions"):
            assert np.array_equal(getattr(packed, name)[r, cols], getattr(padded, name)[e, :n]), name
    pad = packed.segment_ids < 0
    assert (packed.loss_mask[pad] == 0).all() and (packed.token_versions[pad] == -1).all()
    assert (packed.position_ids[pad] == 0).all()


def test_packed_batch_round_trips_and_old_batches_decode_as_padded():
    packed = build_batch(groups((4, 6), (3, 2)), pack_row_tokens=0, pad_to_multiple=8)
    assert packed.input_ids.shape[1] == 16  # the longest episode (10), rounded up to 8
    back = codec.decode(codec.encode(packed), expect=Batch)
    assert np.array_equal(back.segment_ids, packed.segment_ids) and np.array_equal(back.position_ids, packed.position_ids)
    # a Batch encoded before these fields existed: no segment_ids/position_ids on the wire
    old = codec.to_wire(build_batch(groups((4, 6))))
    del old["segment_ids"], old["position_ids"]
    import msgpack

    decoded = codec.decode(msgpack.packb(old, use_bin_type=True), expect=Batch)
    assert not decoded.packed and decoded.segment_ids.shape == (0, 0)


@pytest.mark.parametrize("breakage", ["shape", "range", "count", "positions", "split"])
def test_inconsistent_packing_is_invalid(breakage):
    b = build_batch(groups((4, 6), (3, 2)), pack_row_tokens=40)  # one row: 10 + 10 + 5 + 5 tokens, then padding
    seg, pos = b.segment_ids.copy(), b.position_ids.copy()
    if breakage == "shape":
        seg = seg[:, :-1]
    elif breakage == "range":
        seg[0, 0] = len(b.episode_ids)
    elif breakage == "count":
        seg[0, -1] = 0  # one more token for episode 0 than its seq_len
    elif breakage == "positions":
        pos[0, 1] = 5
    else:  # episode 0's tokens not contiguous: swap one of its tokens with a padding column
        row, cols = np.nonzero(seg == 0)
        last_pad = np.nonzero(seg[row[0]] == -1)[0][-1]
        seg[row[0], cols[-1]], seg[row[0], last_pad] = -1, 0
        pos[row[0], last_pad], pos[row[0], cols[-1]] = pos[row[0], cols[-1]], 0
    b.segment_ids, b.position_ids = seg, pos
    with pytest.raises(InvalidMessage):
        b.validate()


def test_batch_inputs_of_a_packed_batch_is_the_padded_batch_per_episode():
    gs = groups((4, 6), (3, 2), (5, 9))
    padded = batch_inputs(build_batch(gs))
    packed = batch_inputs(build_batch(gs, pack_row_tokens=20))
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]
    assert packed.segment_ids is not None and packed.position_ids is not None
    for name in ("mask", "old_logprobs", "advantages"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name
    # per_episode maps row values back: the rows' token ids come back as the padded rows' ids (0 past the end)
    ids = packed.per_episode(packed.input_ids)
    assert torch.equal(ids, padded.input_ids * torch.as_tensor(packed.unpack_valid))
    assert packed.tokens == padded.tokens


def test_trim_width_of_packed_rows():
    b = build_batch(groups((4, 6), (3, 2)), pack_row_tokens=40)
    assert b.input_ids.shape[1] == 40 and trim_width(b) == 30  # 10 + 10 + 5 + 5 tokens in the one row
    # a (valid) row with padding before its segments: trimming keeps every segment token
    for name, fill in (("segment_ids", -1), ("position_ids", 0), ("input_ids", 0), ("loss_mask", 0),
                       ("old_logprobs", 0), ("token_versions", -1)):
        arr = getattr(b, name)
        setattr(b, name, np.concatenate([np.full((arr.shape[0], 3), fill, dtype=arr.dtype), arr[:, :-3]], axis=1))
    b.validate()
    assert trim_width(b) == 33
    inputs = batch_inputs(b)
    assert inputs.mask.sum() == int(b.loss_mask.sum()) and bool(inputs.unpack_valid.sum() == b.seq_lens.sum())


def test_state_machine_packs_when_configured():
    cfg = BufferConfig(groups_per_batch=2, batching="pack", pack_row_tokens=64, max_batch_wait_s=1.0)
    st = BufferState(cfg)
    for g in range(2):
        for i, e in enumerate(make_group(f"g{g}", 4, rewards=[0, 1, 0, 1])):
            st.add(e, partition=0, offset=4 * g + i, now=0.0)
    [d] = st.take_decisions(now=0.0, latest_version=None)
    assert d.batch.packed and d.batch.input_ids.shape == (4, 64)  # 8 episodes of 24 tokens, 2 per row
    d.batch.validate()
    with pytest.raises(ConfigError):
        BufferConfig(batching="squash")
