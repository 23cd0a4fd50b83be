"""Shared-prefix rows (``consumers/prefix.py``): a group's common prefix once per row, each episode's suffix after
it, and the map back to the padded episode layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consumers.config import TrainerConfig
from consumers.prefix import attention_mask, common_prefix, shared_prefix_layout
from consumers.step import batch_inputs
from topics.errors import ConfigError
from topics.schemas import Batch


def batch(groups: list[tuple[list[int], list[list[int]]]], masks: list[list[int]] | None = None) -> Batch:
    """Padded batch of groups given as (prompt tokens, [response tokens per episode]); ``masks`` overrides the
    response part of each episode's loss mask (environment tokens are 0)."""
    seqs, plens, gids = [], [], []
    for g, (prompt, responses) in enumerate(groups):
        for r in responses:
            seqs.append(prompt + r)
            plens.append(len(prompt))
            gids.append(f"g{g}")
    t = max(map(len, seqs))
    ids = np.zeros((len(seqs), t), np.int32)
    mask = np.zeros((len(seqs), t), np.uint8)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, plens[i]:len(s)] = masks[i] if masks else 1
    old = np.where(mask > 0, -0.5, 0).astype(np.float32)
    b = len(seqs)
    return Batch(batch_id="b", episode_ids=[f"e{i}" for i in range(b)], group_ids=gids, input_ids=ids,
                 loss_mask=mask, old_logprobs=old, token_versions=np.where(mask > 0, 0, -1).astype(np.int32),
                 advantages=np.arange(b, dtype=np.float32), rewards=np.zeros(b, np.float32),
                 prompt_lens=np.asarray(plens, np.int32), seq_lens=np.asarray(list(map(len, seqs)), np.int32))


def test_common_prefix_stops_at_the_first_difference_and_before_any_trained_token():
    ids = np.array([[5, 6, 7, 8, 9], [5, 6, 7, 1, 9]])
    lens = np.array([5, 5])
    assert common_prefix(ids, lens, np.zeros((2, 5), bool)) == 3
    mask = np.zeros((2, 5), bool)
    mask[1, 2] = True
    assert common_prefix(ids, lens, mask) == 2
    assert common_prefix(ids[:1], np.array([4]), np.zeros((1, 5), bool)) == 4


def test_a_group_is_one_row_its_prompt_once_and_each_suffix_after_it():
    b = batch([([1, 2, 3], [[10, 11], [20], [30, 31, 32]]), ([4, 5], [[40, 41], [50]])])
    rows = shared_prefix_layout(b, b.input_ids.shape[1], row_tokens=64)
    assert rows.input_ids.shape == (2, 9)  # 3 + 2 + 1 + 3 tokens; 2 + 2 + 1 padded to 9
    assert rows.input_ids[0].tolist() == [1, 2, 3, 10, 11, 20, 30, 31, 32]
    assert rows.segment_ids[0].tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 3]
    assert rows.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 5]
    assert rows.prev[0, 3:].tolist() == [2, 3, 2, 2, 6, 7]  # a suffix's first token is predicted by the prompt's last
    assert rows.segment_ids[1].tolist() == [0, 0, 1, 1, 2, -1, -1, -1, -1]
    assert rows.scored[0].tolist() == [False] * 3 + [True] * 6
    # every episode token maps back to its own token, and nothing past the episode is valid
    flat = rows.input_ids.reshape(-1)
    for e in range(len(b.episode_ids)):
        n = int(b.seq_lens[e])
        assert rows.unpack_valid[e].tolist() == [True] * n + [False] * (rows.unpack_valid.shape[1] - n)
        assert flat[rows.unpack_index[e, :n]].tolist() == b.input_ids[e, :n].tolist()


def test_a_group_longer_than_a_row_continues_in_another_row_with_its_own_prompt():
    b = batch([([1, 2, 3], [[10, 11, 12], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37]])])
    rows = shared_prefix_layout(b, b.input_ids.shape[1], row_tokens=9)
    assert rows.input_ids.shape[0] == 2
    assert rows.input_ids[0].tolist()[:9] == [1, 2, 3, 10, 11, 12, 20, 21, 22]
    assert rows.input_ids[1].tolist()[:11] == [1, 2, 3, 30, 31, 32, 33, 34, 35, 36, 37]  # wider than the cap: alone
    flat = rows.input_ids.reshape(-1)
    assert flat[rows.unpack_index[2, :11]].tolist() == b.input_ids[2, :11].tolist()


def test_environment_tokens_stay_in_the_suffix_unscored():
    b = batch([([1, 2], [[10, 90, 91, 11], [20, 92, 21, 22]])], masks=[[1, 0, 0, 1], [1, 0, 1, 1]])
    rows = shared_prefix_layout(b, b.input_ids.shape[1], row_tokens=64)
    assert rows.scored[0, :10].tolist() == [False, False, True, False, False, True, True, False, True, True]


def test_the_mask_lets_a_suffix_see_the_prompt_and_itself_only():
    seg = torch.tensor([[0, 0, 1, 1, 2, -1]])
    m = attention_mask(seg)[0, 0]
    assert m[3].tolist() == [True, True, True, True, False, False]
    assert m[4].tolist() == [True, True, False, False, True, False]
    assert m[1].tolist() == [True, True, False, False, False, False]
    assert m[5].tolist() == [False, False, False, False, False, True]  # padding sees itself: no empty query row


def test_batch_inputs_in_shared_prefix_rows_keep_the_episode_tensors():
    b = batch([([1, 2, 3], [[10, 11], [20]]), ([4, 5], [[40, 41, 42], [50]])])
    padded, shared = batch_inputs(b), batch_inputs(b, shared_prefix_tokens=64)
    assert shared.input_ids.shape[0] == 2 and shared.attn_mask.shape == (2, 1, 6, 6)  # 3 + 2 + 1 and 2 + 3 + 1
    assert torch.equal(padded.mask, shared.mask) and torch.equal(padded.old_logprobs, shared.old_logprobs)
    assert torch.equal(padded.advantages, shared.advantages) and shared.tokens == padded.tokens == 7
    back = shared.per_episode(shared.input_ids)
    assert torch.equal(back, padded.input_ids)


def test_shared_prefix_config():
    assert TrainerConfig(shared_prefix=True).shared_prefix_tokens == 1024
    with pytest.raises(ConfigError, match="trainer.shared_prefix_tokens"):
        TrainerConfig(shared_prefix_tokens=1)


def test_an_empty_batch_gives_no_rows():
    """A rank's empty share of a batch lays out as zero rows, not an error."""
    b = batch([([1, 2, 3], [[10, 11]])])
    empty = Batch(batch_id="b", episode_ids=[], group_ids=[], input_ids=b.input_ids[:0], loss_mask=b.loss_mask[:0],
                  old_logprobs=b.old_logprobs[:0], token_versions=b.token_versions[:0],
                  advantages=b.advantages[:0], rewards=b.rewards[:0], prompt_lens=b.prompt_lens[:0],
                  seq_lens=b.seq_lens[:0])
    rows = shared_prefix_layout(empty, empty.input_ids.shape[1], row_tokens=64)
    assert rows.input_ids.shape == (0, 2) and rows.unpack_index.shape == (0, 2) and not rows.scored.any()
