"""Data-parallel shares of a Batch (``consumers.engine.split_rows``): whole rows, every field, packed rows renumbered,
an empty share padded with a masked-out row; ``batch_totals``; the TP config checks."""

from __future__ import annotations

import numpy as np
import pytest

from consumers.config import TrainerConfig
from consumers.engine import batch_totals, global_metrics, split_rows
from consumers.parallel import Dist
from topics.errors import ConfigError
from topics.schemas import Batch


def padded(b: int = 5, t: int = 9) -> Batch:
    rng = np.random.default_rng(0)
    seq = np.array([9, 5, 7, 4, 6][:b], dtype=np.int32)
    mask = np.zeros((b, t), np.uint8)
    for i in range(b):
        mask[i, 2:seq[i]] = 1
    return Batch(batch_id="x", episode_ids=[f"e{i}" for i in range(b)], group_ids=[f"g{i // 2}" for i in range(b)],
                 input_ids=rng.integers(1, 60, (b, t)).astype(np.int32), loss_mask=mask,
                 old_logprobs=-rng.random((b, t)).astype(np.float32), token_versions=np.zeros((b, t), np.int32),
                 advantages=np.arange(b, dtype=np.float32) + 1, rewards=np.arange(b, dtype=np.float32),
                 prompt_lens=np.full(b, 2, np.int32), seq_lens=seq)


def test_uneven_rows_split_into_contiguous_whole_rows():
    batch = padded()
    shares = [split_rows(batch, r, 2) for r in range(2)]
    assert [n for _, n in shares] == [3, 2]
    assert shares[0][0].episode_ids == ["e0", "e1", "e2"] and shares[1][0].episode_ids == ["e3", "e4"]
    for name in ("input_ids", "loss_mask", "old_logprobs", "token_versions", "advantages", "rewards", "prompt_lens",
                 "seq_lens"):
        assert np.array_equal(np.concatenate([getattr(s, name) for s, _ in shares]), getattr(batch, name)), name
    for share, _ in shares:
        share.validate()
    assert sum(float(s.loss_mask.sum()) for s, _ in shares) == batch_totals(batch).tokens
    totals = batch_totals(batch)
    assert (totals.rows, totals.width) == (5, 9)


def test_a_rank_without_rows_gets_a_masked_out_row():
    batch = padded(b=2)
    shares = [split_rows(batch, r, 3) for r in range(3)]
    assert [n for _, n in shares] == [1, 1, 0]
    empty, _ = shares[2]
    assert empty.input_ids.shape[0] == 1 and not empty.loss_mask.any() and not empty.advantages.any()


def test_packed_rows_keep_whole_episodes_and_renumber_segments():
    # 5 episodes in 3 packed rows: [e0 e1] [e2] [e3 e4]
    lens = [3, 4, 6, 2, 3]
    rows = [[0, 1], [2], [3, 4]]
    t = 8
    seg = np.full((3, t), -1, np.int32)
    pos = np.zeros((3, t), np.int32)
    for r, eps in enumerate(rows):
        at = 0
        for e in eps:
            seg[r, at:at + lens[e]] = e
            pos[r, at:at + lens[e]] = np.arange(lens[e])
            at += lens[e]
    mask = (seg >= 0).astype(np.uint8) & (pos >= 1)
    batch = Batch(batch_id="p", episode_ids=[f"e{i}" for i in range(5)], group_ids=["g"] * 5,
                  input_ids=np.where(seg >= 0, 7, 0).astype(np.int32), loss_mask=mask.astype(np.uint8),
                  old_logprobs=np.zeros((3, t), np.float32), token_versions=np.zeros((3, t), np.int32),
                  advantages=np.arange(5, dtype=np.float32), rewards=np.zeros(5, np.float32),
                  prompt_lens=np.ones(5, np.int32), seq_lens=np.array(lens, np.int32), segment_ids=seg,
                  position_ids=pos)
    batch.validate()
    (a, na), (b, nb) = split_rows(batch, 0, 2), split_rows(batch, 1, 2)
    assert (na, nb) == (3, 2)
    assert a.episode_ids == ["e0", "e1", "e2"] and b.episode_ids == ["e3", "e4"]
    assert np.array_equal(b.segment_ids[0, :5], [0, 0, 1, 1, 1]) and np.array_equal(b.advantages, [3.0, 4.0])
    a.validate()
    b.validate()
    assert batch_totals(batch).width == 6 and batch_totals(batch).rows == 5


def test_metrics_of_one_process_pass_through_with_a_nonfinite_flag():
    assert global_metrics(Dist(), {"loss": 1.5, "tokens": 3.0}) == {"loss": 1.5, "tokens": 3.0}
    assert global_metrics(Dist(), {"loss": float("nan")})["nonfinite"] == 1.0


def test_tp_must_divide_the_world_size():
    assert TrainerConfig(world_size=4, tp=2).dp == 2
    for bad in ({"world_size": 2, "tp": 3}, {"world_size": 2, "tp": 0}):
        with pytest.raises(ConfigError, match="trainer.tp"):
            TrainerConfig(**bad)
