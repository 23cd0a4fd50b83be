"""The generator's commit and backpressure rules (producers/flow.py), without brokers."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from producers.flow import Backpressure, OffsetTracker, quota_phase


def test_commits_only_the_contiguous_completed_prefix():
    t = OffsetTracker()
    for o in (5, 6, 7, 8):
        t.take("p0", o)
    t.done("p0", 6)
    t.done("p0", 8)
    assert t.committable() == {}  # 5 still running
    t.done("p0", 5)
    assert t.committable() == {"p0": 7}
    t.committed({"p0": 7})
    assert t.committable() == {}
    t.done("p0", 7)
    assert t.committable() == {"p0": 9}
    t.committed({"p0": 9})
    assert t.in_flight() == 0 and t.committable() == {}


def test_partitions_are_independent_and_revoked_ones_forgotten():
    t = OffsetTracker()
    t.take("a", 0)
    t.take("b", 10)
    t.done("b", 10)
    assert t.committable() == {"b": 11}
    t.forget(["a"])
    t.done("a", 0)  # finished after the revoke: ignored, the new owner redoes it
    assert "a" not in t.committable()


def test_gaps_left_by_the_broker_do_not_block_commits():
    t = OffsetTracker()
    t.take("p", 0)
    t.take("p", 3)  # 1 and 2 never delivered (control records / compaction)
    t.done("p", 3)
    t.done("p", 0)
    assert t.committable() == {"p": 4}


def test_redelivery_below_the_commit_point_is_ignored():
    t = OffsetTracker()
    t.take("p", 0)
    t.done("p", 0)
    t.committed(t.committable())
    t.take("p", 0)
    assert t.in_flight() == 0 and t.committable() == {}


@given(st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_random_completion_orders_commit_exactly_the_done_prefix(n, seed):
    rng = random.Random(seed)
    t = OffsetTracker()
    for o in range(n):
        t.take("p", o)
    order = list(range(n))
    rng.shuffle(order)
    done: set[int] = set()
    committed = 0
    for o in order:
        t.done("p", o)
        done.add(o)
        c = t.committable()
        prefix = 0
        while prefix in done:
            prefix += 1
        if prefix > committed:
            assert c == {"p": prefix}
            t.committed(c)
            committed = prefix
        else:
            assert c == {}
    assert committed == n


def test_backpressure_on_stale_weights():
    bp = Backpressure(max_policy_lag=1)
    assert bp.open(engine_version=0)  # nothing published yet
    bp.published(1)
    assert bp.open(0)
    bp.published(2)
    assert not bp.open(0) and "lag" in bp.reason(0)
    assert bp.open(1)  # the receiver loaded version 1
    bp.published(1)  # an older announcement never lowers latest
    assert bp.latest == 2


def test_backpressure_quota_holds_at_most_the_window_beyond_the_trainers_step():
    bp = Backpressure(max_policy_lag=1, groups_per_step=2, window_steps=2)
    assert bp.quota() == 4 and bp.open(0)  # no trainer yet: the window's worth, never a flood
    bp.took(4)
    assert not bp.open(0) and bp.ahead() and "ahead of the trainer" in bp.reason(0)
    bp.published(0, step=1)  # the trainer trained a step: 2 more
    assert bp.quota() == 6 and bp.open(0)
    bp.took(2)
    assert not bp.open(0)
    bp.published(1, step=4)  # one version covering three steps (publish_busy: skip) counts three steps
    assert bp.quota() == 12
    bp.grant()  # liveness guard: one step's worth
    assert bp.quota() == 14


def test_a_restarted_generator_counts_from_the_trainers_step_when_it_started():
    bp = Backpressure(max_policy_lag=1, groups_per_step=2.5, window_steps=2)
    bp.started_at(500)
    assert bp.quota() == 5  # floor(2 * 2.5)
    bp.published(90, step=501)
    assert bp.quota() == 7  # floor(3 * 2.5)


def test_a_batch_cut_short_opens_the_quota_by_the_groups_it_held():
    """Counted in groups trained, short batches (``buffer.max_batch_wait_s``) do not widen the window: the surplus
    that a step-counted quota let through aged in the buffer and was dropped as stale."""
    groups = Backpressure(max_policy_lag=0, groups_per_step=4, window_steps=2, groups_per_batch=4)
    steps = Backpressure(max_policy_lag=0, groups_per_step=4, window_steps=2)
    groups.started_at(0, None)  # a new run: no progress in the store, the groups count from 0
    assert groups.quota() == steps.quota() == 8
    trained = 0
    for step in range(1, 11):  # ten batches of 3 groups of the 4 a batch holds
        trained += 3
        for bp in (groups, steps):
            bp.progressed(step, version=step, groups=trained)
    assert groups.quota() == 30 + 8  # the groups trained, plus the window of two full batches
    assert steps.quota() == 40 + 8  # counted in steps: ten groups more than the trainer took
    groups.took(38)
    assert "7.50 batches trained" in groups.reason(10)


def test_the_group_count_falls_back_to_steps_where_the_trainer_does_not_report_it():
    old = Backpressure(max_policy_lag=0, groups_per_step=2, window_steps=1, groups_per_batch=2)
    old.progressed(3, version=3)  # a v1 TrainerProgress: no groups
    assert old.quota() == (3 + 1) * 2
    resumed = Backpressure(max_policy_lag=0, groups_per_step=2, window_steps=1, groups_per_batch=2)
    resumed.started_at(10, -1)  # a trainer resumed from a checkpoint that did not record them
    resumed.progressed(12, version=12, groups=-1)
    assert resumed.quota() == (2 + 1) * 2
    late = Backpressure(max_policy_lag=0, groups_per_step=2, window_steps=1, groups_per_batch=2)
    late.started_at(10, 17)  # a late join: counts from the groups trained when it started
    late.progressed(11, version=11, groups=19)
    assert late.quota() == 2 + 2
    late.progressed(11, version=11, groups=18)  # an older report (a trainer restarted from its checkpoint) lowers nothing
    assert late.quota() == 4
    no_progress = Backpressure(max_policy_lag=0, groups_per_step=2, window_steps=1, groups_per_batch=2)
    no_progress.started_at(10, None)  # a version in the store but no progress: in steps
    no_progress.progressed(11, version=11, groups=40)
    assert no_progress.quota() == (1 + 1) * 2


def test_backpressure_rate_matches_the_trainer_over_many_steps():
    """Cumulative, not reset per version: over k steps the generator takes (k + window) * groups_per_step."""
    bp = Backpressure(max_policy_lag=2, groups_per_step=3, window_steps=2)
    for step in range(1, 50):
        while bp.open(step - 1):
            bp.took()
        bp.published(step, step=step)
    assert bp.taken == (48 + 2) * 3


def fleet_quota(bps: list[Backpressure]) -> int:
    return sum(bp.quota() or 0 for bp in bps)


@pytest.mark.parametrize(("generators", "per_batch", "window"), [(256, 64, 4), (256, 64, 3), (100, 64, 1),
                                                                 (3, 8, 4), (1000, 64, 2)])
def test_a_fleet_of_fractional_shares_holds_the_windows_groups(generators: int, per_batch: int, window: int):
    """More generators than groups per batch: each share is a fraction of a group per step, and the phases spread
    the fleet's quotas so that together they hold the window's groups, within one, at every trainer step."""
    bps = [Backpressure(max_policy_lag=1, groups_per_step=per_batch / generators, window_steps=window,
                        phase=quota_phase(f"generator-{i}")) for i in range(generators)]
    for step in range(40):
        for bp in bps:
            bp.published(step, step=step)
        assert abs(fleet_quota(bps) - (step + window) * per_batch) <= 1, step
    # without phases every quota floors alike, all at the same step: 256 generators at a quarter group each
    # hold the window's groups at one step in four, and at the step before it a window three steps short
    if generators == 256 and window == 4:
        plain = [Backpressure(max_policy_lag=1, groups_per_step=0.25, window_steps=4) for _ in range(generators)]
        for bp in plain:
            bp.published(3, step=3)
        assert fleet_quota(plain) == 256 and (3 + window) * per_batch == 448


def test_a_quarter_group_a_step_is_one_group_every_four_steps():
    bp = Backpressure(max_policy_lag=1, groups_per_step=0.25, window_steps=3, phase=quota_phase("generator-1"))
    assert bp.phase == pytest.approx(0.618, abs=1e-3)
    assert bp.quota() == 1 and bp.open(0)  # floor(3 * 0.25 + 0.618): its window holds one group already
    bp.took()
    takes = []
    for step in range(1, 17):
        bp.published(step, step=step)
        if bp.open(step):
            bp.took()
            takes.append(step)
    assert takes == [3, 7, 11, 15]  # one every four steps, at this generator's own phase
    assert Backpressure(max_policy_lag=1, groups_per_step=0.25, window_steps=3).quota() == 0  # phase 0: none yet


def test_quota_phases_come_from_the_generators_index():
    assert quota_phase("generator-0") == 0.0  # a lone generator's quota is the plain floor
    assert quota_phase("sim7") == quota_phase("generator-7")
    phases = sorted(quota_phase(f"generator-{i}") for i in range(64))
    assert max(b - a for a, b in zip([0.0, *phases], [*phases, 1.0], strict=True)) < 2.5 / 64  # evenly spread
    other = quota_phase("host-a.example")  # no index: a phase from the id's hash, stable across processes
    assert 0.0 <= other < 1.0 and other == quota_phase("host-a.example")


def test_zero_variance_groups_give_their_quota_back():
    """With the buffer filtering zero-variance groups, such a group trains nothing: it uses no quota."""
    bp = Backpressure(max_policy_lag=0, groups_per_step=2, window_steps=1, count_zero_variance=False)
    bp.published(0, step=0)
    bp.took(2)
    assert not bp.open(0)
    bp.scored([1.0, 1.0, 1.0])  # all equal: refunded
    assert bp.open(0) and bp.taken == 1 and bp.refunded == 1
    bp.scored([0.0, 1.0])  # signal: counts
    assert bp.taken == 1
    counting = Backpressure(max_policy_lag=0, groups_per_step=2, window_steps=1)  # the default counts every group
    counting.took(2)
    counting.scored([0.0, 0.0])
    assert counting.taken == 2


def test_the_liveness_guard_scales_with_the_interval_between_versions():
    assert Backpressure(max_policy_lag=1, stall_s_config=7.5).stall_s() == 7.5
    bp = Backpressure(max_policy_lag=1)
    assert bp.stall_s() == 30.0  # before two versions were seen: the trainer may still be loading
    for i in range(4):
        bp.published(i, now=100.0 + 4.0 * i)  # a version every 4 s
    assert bp.stall_s() == 12.0
    fast = Backpressure(max_policy_lag=1)
    fast.published(0, now=0.0)
    fast.published(1, now=0.1)
    assert fast.stall_s() == 2.0  # at least 2 s
    quarter = Backpressure(max_policy_lag=1, groups_per_step=0.25)
    for i in range(4):
        quarter.published(i, now=100.0 + 4.0 * i)
    assert quarter.stall_s() == 48.0  # a quarter group a step: four steps between its groups by design


def test_build_episodes_ids_versions_and_lengths():
    import numpy as np

    from producers.engine import Completion
    from producers.pipeline import build_episodes
    from topics.schemas import Prompt

    prompt = Prompt(prompt_id="addmod10-0-3", task="addmod10", text="1+2=", answer="3", created_at=0.0)
    completions = [
        Completion(index=0, token_ids=[7, 2], logprobs=[-0.1, -0.2], versions=[4, 5], text="3",
                   finish_reason="stop", generate_s=0.5),
        Completion(index=1, token_ids=[], logprobs=[], versions=[], text="", finish_reason="length"),
    ]
    eps = build_episodes(prompt, [1, 5, 41, 6, 45], completions, generator_id="g", engine_version=6, queued_s=0.25)
    assert [e.episode_id for e in eps] == ["addmod10-0-3/0", "addmod10-0-3/1"]
    assert all(e.group_id == "addmod10-0-3" and e.group_size == 2 and e.generator_id == "g" for e in eps)
    assert eps[0].policy_version == 4 and eps[0].min_version == 4  # the version of the first response token
    assert eps[1].policy_version == 6  # no tokens: the engine's version
    assert eps[0].response_tokens.dtype == np.int32 and eps[0].logprobs.dtype == np.float32
    assert list(eps[0].token_versions) == [4, 5] and list(eps[0].prompt_tokens) == [1, 5, 41, 6, 45]
    assert eps[0].timings == {"queued_s": 0.25, "first_token_s": 0.0, "generate_s": 0.5}
    for e in eps:
        e.validate()


def test_token_versions_come_from_vllms_weight_version_spans():
    """A finished sample's spans (vLLM's ``WeightVersionSpan``: label, start, end) become one version per token;
    no spans (an unlabelled engine) means the engine's version for all; spans that miss tokens are an error."""
    from vllm.outputs import WeightVersionSpan

    from producers.engine import _token_versions

    spans = [WeightVersionSpan("3", 0, 2), WeightVersionSpan("4", 2, 5)]
    assert _token_versions(spans, 5, fallback=9) == [3, 3, 4, 4, 4]
    assert _token_versions(None, 3, fallback=9) == [9, 9, 9]
    with pytest.raises(RuntimeError, match="cover 5 of 6 tokens"):
        _token_versions(spans, 6, fallback=9)


def test_sampled_logprobs_read_vllms_flat_lists_and_its_per_position_dicts():
    """The sampled token's logprob per position from vLLM's ``FlatLogprobs`` (what the engine asks for) and from
    the per-position ``{token_id: Logprob}`` dicts; a count that does not match the tokens is an error."""
    from vllm.logprobs import FlatLogprobs, Logprob

    from producers.engine import _sampled_logprobs

    flat = FlatLogprobs()
    for tok, lp in ((5, -0.25), (7, -1.5)):
        flat.append({tok: Logprob(logprob=lp, rank=1, decoded_token=None)})
    assert _sampled_logprobs(flat, [5, 7]) == [-0.25, -1.5]
    dicts = [{5: Logprob(-0.25, 1, None), 9: Logprob(-3.0, 2, None)}, {7: Logprob(-1.5, 1, None)}]
    assert _sampled_logprobs(dicts, [5, 7]) == [-0.25, -1.5]
    with pytest.raises(RuntimeError, match="2 logprob entries for 3 tokens"):
        _sampled_logprobs(flat, [5, 7, 8])
