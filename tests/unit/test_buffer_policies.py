"""Pure buffer policies: advantages, reward shaping, filters, batching and the Batch layout (no broker)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.policies import (
    Reason,
    ScoredGroup,
    batch_cost,
    batch_id_of,
    build_batch,
    group_advantages,
    is_fenced,
    is_overlong,
    is_stale,
    is_zero_variance,
    plan_batches,
    score_group,
    shape_rewards,
)
from topics import codec
from topics.schemas import Batch, Episode


def ep(gid: str, i: int, *, reward: float = 0.0, prompt: int = 3, resp: int = 4, version: int = 0,
       versions: list[int] | None = None, finish: str = "stop", size: int = 4) -> Episode:
    return Episode(
        episode_id=f"{gid}/{i}", group_id=gid, group_size=size, prompt_id=gid,
        prompt_tokens=np.arange(1, prompt + 1, dtype=np.int32),
        response_tokens=np.arange(10 + i, 10 + i + resp, dtype=np.int32) % 60,
        logprobs=-np.linspace(0.1, 1.0, resp).astype(np.float32),
        token_versions=np.asarray(versions if versions is not None else [version] * resp, dtype=np.int32),
        policy_version=version, reward=reward, finish_reason=finish,
    )


def test_grpo_matches_reference_formula():
    r = [1.0, 0.0, 0.0, 1.0, 0.5]
    expect = (np.array(r) - np.mean(r)) / (np.std(r, ddof=1) + 1e-4)
    np.testing.assert_allclose(group_advantages(r, "grpo", eps=1e-4), expect, rtol=1e-6)


def test_dr_grpo_is_centred_reward():
    np.testing.assert_allclose(group_advantages([3.0, 1.0, 2.0], "dr_grpo"), [1.0, -1.0, 0.0])


def test_rloo_is_leave_one_out_baseline():
    r = np.array([1.0, 0.0, 0.5, 0.25])
    loo = np.array([r[i] - np.delete(r, i).mean() for i in range(len(r))])
    np.testing.assert_allclose(group_advantages(r, "rloo"), loo, rtol=1e-6)


@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=16), st.sampled_from(["grpo", "dr_grpo", "rloo"]))
@settings(max_examples=60, deadline=None)
def test_advantages_sum_to_zero_and_keep_order(rewards, method):
    adv = group_advantages(rewards, method)
    assert abs(float(adv.sum())) < 1e-3 * max(1.0, float(np.abs(adv).max()))
    r = np.asarray(rewards)
    i, j = int(r.argmax()), int(r.argmin())
    assert adv[i] >= adv[j]


def test_single_episode_group_has_zero_advantage():
    for method in ("grpo", "dr_grpo", "rloo"):
        assert group_advantages([0.7], method).tolist() == [0.0]
    with pytest.raises(ValueError):
        group_advantages([1.0, 0.0], "ppo")


def test_reward_scale_and_clip():
    np.testing.assert_allclose(shape_rewards([1.0, -3.0, 0.2], scale=2.0, clip=1.5), [1.5, -1.5, 0.4])
    np.testing.assert_allclose(shape_rewards([1.0, -3.0], scale=2.0), [2.0, -6.0])


def test_filters():
    assert is_zero_variance([1.0, 1.0, 1.0]) and is_zero_variance([0.3]) and not is_zero_variance([0.0, 1.0])
    e = ep("g", 0, versions=[3, 4, 5, 5])  # oldest token version 3
    assert not is_stale(e, None, 0)
    assert not is_stale(e, 5, 2) and is_stale(e, 6, 2)
    assert is_overlong(ep("g", 0, resp=9), 8) and not is_overlong(ep("g", 0, resp=8), 8)
    assert not is_overlong(ep("g", 0, resp=99), 0)
    assert is_overlong(ep("g", 0, finish="length"), 0, filter_truncated=True)
    assert not is_overlong(ep("g", 0, finish="length"), 0)


def test_score_group_drops_each_episode_once_with_its_reason():
    eps = [ep("g", 0, reward=1.0, resp=20), ep("g", 1, reward=1.0, version=0), ep("g", 2, reward=0.0, version=5),
           ep("g", 3, reward=1.0, version=5)]
    v = score_group("g", list(reversed(eps)), latest_version=5, max_policy_lag=1, max_response_tokens=10)
    assert v.dropped == {Reason.OVERLONG: ["g/0"], Reason.STALE: ["g/1"]}
    assert v.kept is not None and v.kept.episode_ids == ["g/2", "g/3"]  # sorted, whatever the arrival order
    assert v.kept.advantages[0] < 0 < v.kept.advantages[1]


def test_score_group_zero_variance_remainder_dropped():
    eps = [ep("g", i, reward=1.0) for i in range(4)]
    v = score_group("g", eps, latest_version=0, max_policy_lag=0)
    assert v.kept is None and v.dropped == {Reason.ZERO_VARIANCE: ["g/0", "g/1", "g/2", "g/3"]}
    kept = score_group("g", eps, latest_version=0, max_policy_lag=0, filter_zero_variance=False).kept
    assert kept is not None and kept.advantages.tolist() == [0.0] * 4
    # a group left with one episode after the filters carries no signal either
    v = score_group("g", [ep("g", 0, reward=1.0, resp=30), ep("g", 1, reward=0.0)], latest_version=0,
                    max_policy_lag=0, max_response_tokens=10)
    assert v.dropped == {Reason.OVERLONG: ["g/0"], Reason.ZERO_VARIANCE: ["g/1"]}


def test_batch_id_is_order_independent_and_distinct():
    assert batch_id_of(["a/1", "b/0", "a/0"]) == batch_id_of(["a/0", "a/1", "b/0"])
    assert batch_id_of(["a/0", "a/1"]) != batch_id_of(["a/0", "a/2"])
    assert len(batch_id_of(["x"])) == 32


def _group(gid: str, n: int = 2, resp: int = 4) -> ScoredGroup:
    eps = [ep(gid, i, reward=float(i), resp=resp) for i in range(n)]
    return ScoredGroup(gid, eps, group_advantages([e.reward for e in eps]))


def test_plan_batches_by_group_count():
    groups = [_group(f"g{i}") for i in range(5)]
    batches, rest = plan_batches(groups, groups_per_batch=2)
    assert [[g.group_id for g in b] for b in batches] == [["g0", "g1"], ["g2", "g3"]]
    assert [g.group_id for g in rest] == ["g4"]
    batches, rest = plan_batches(groups, groups_per_batch=2, final=True)
    assert len(batches) == 3 and rest == []


def test_plan_batches_by_token_budget_never_splits_a_group():
    groups = [_group("a", 2, resp=4), _group("b", 2, resp=4), _group("c", 4, resp=20)]  # rows of 7, 7, 23 tokens
    assert batch_cost(groups[:2]) == 4 * 7 and batch_cost(groups[:2], "tokens") == 28
    batches, rest = plan_batches(groups, groups_per_batch=99, token_budget=30, final=True)
    assert [[g.group_id for g in b] for b in batches] == [["a", "b"], ["c"]]  # c alone exceeds the budget
    assert rest == []
    batches, rest = plan_batches(groups[:2], groups_per_batch=99, token_budget=100)
    assert batches == [] and len(rest) == 2


def test_build_batch_layout_follows_schema_conventions():
    g1 = ScoredGroup("a", [ep("a", 0, reward=1.0, prompt=2, resp=3, versions=[1, 1, 2]),
                           ep("a", 1, reward=0.0, prompt=2, resp=5, version=2)], np.array([0.7, -0.7], np.float32))
    g2 = ScoredGroup("b", [ep("b", 0, reward=0.5, prompt=4, resp=1, version=2)], np.array([0.0], np.float32))
    b = build_batch([g1, g2], pad_token_id=63, pad_to_multiple=8, buffer_id="buf")
    assert b.input_ids.shape == (3, 8)  # longest row 7 rounded up to 8
    assert b.episode_ids == ["a/0", "a/1", "b/0"] and b.group_ids == ["a", "a", "b"]
    assert b.batch_id == batch_id_of(b.episode_ids)
    e0 = g1.episodes[0]
    assert b.input_ids[0, :5].tolist() == [*e0.prompt_tokens.tolist(), *e0.response_tokens.tolist()]
    assert b.input_ids[0, 5:].tolist() == [63, 63, 63]
    assert b.loss_mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    np.testing.assert_allclose(b.old_logprobs[0, 2:5], e0.logprobs)
    assert b.old_logprobs[0, :2].tolist() == [0, 0] and b.token_versions[0].tolist() == [-1, -1, 1, 1, 2, -1, -1, -1]
    assert b.prompt_lens.tolist() == [2, 2, 4] and b.seq_lens.tolist() == [5, 7, 5]
    np.testing.assert_allclose(b.advantages, [0.7, -0.7, 0.0])
    assert b.rewards.tolist() == [1.0, 0.0, 0.5]
    assert b.stats["min_version"] == 1 and b.stats["max_version"] == 2 and b.stats["groups"] == 2
    back = codec.decode(codec.encode(b), expect=Batch)  # valid on the wire
    assert back.batch_id == b.batch_id and np.array_equal(back.input_ids, b.input_ids)


def test_fenced_generator_episodes_newer_than_its_last_ack_are_dropped():
    def gen_ep(i, gen, versions):
        e = ep("g", i, reward=float(i % 2), versions=versions)
        e.generator_id = gen
        return e

    fenced = {"gen-a": 3}
    assert is_fenced(gen_ep(0, "gen-a", [3, 4, 4, 4]), fenced)  # a token from version 4: never acknowledged
    assert not is_fenced(gen_ep(0, "gen-a", [3, 3, 3, 3]), fenced)
    assert not is_fenced(gen_ep(0, "gen-b", [9, 9, 9, 9]), fenced) and not is_fenced(gen_ep(0, "gen-a", [9] * 4), {})
    eps = [gen_ep(0, "gen-a", [4] * 4), gen_ep(1, "gen-b", [4] * 4), gen_ep(2, "gen-b", [4] * 4),
           gen_ep(3, "gen-b", [4] * 4)]
    v = score_group("g", eps, latest_version=4, max_policy_lag=0, fenced=fenced)
    assert v.dropped == {Reason.FENCED: ["g/0"]} and v.kept is not None and v.kept.episode_ids == ["g/1", "g/2", "g/3"]
