"""The buffer state machine: dedup, completion, timeouts, verdicts, batches and offsets (no broker)."""

from __future__ import annotations

import numpy as np

from buffer.config import BufferConfig
from buffer.policies import Reason
from buffer.state import BufferState
from topics.schemas import Episode


def ep(gid: str, i: int, *, reward: float | None = None, size: int = 2, version: int = 0, resp: int = 3) -> Episode:
    return Episode(
        episode_id=f"{gid}/{i}", group_id=gid, group_size=size, prompt_id=gid,
        prompt_tokens=np.array([1, 2], dtype=np.int32), response_tokens=np.full(resp, 5, dtype=np.int32),
        logprobs=np.full(resp, -0.5, dtype=np.float32), token_versions=np.full(resp, version, dtype=np.int32),
        policy_version=version, reward=float(i % 2) if reward is None else reward,
    )


def cfg(**kw) -> BufferConfig:
    base = {"groups_per_batch": 2, "group_timeout_s": 10.0, "max_batch_wait_s": 100.0}
    base.update(kw)
    return BufferConfig(**base)


def feed(state: BufferState, records, *, partition=0, start=0, now=0.0):
    return [state.add(e, partition=partition, offset=start + k, now=now) for k, e in enumerate(records)]


def ack_all(state, decisions):
    for d in decisions:
        state.ack(d)


def test_groups_complete_then_batch_and_offsets_commit_after_ack():
    s = BufferState(cfg())
    assert feed(s, [ep("a", 0), ep("b", 0), ep("a", 1)]) == ["pending", "pending", "complete"]
    assert s.take_decisions(now=1, latest_version=0) == []  # one scored group, batch needs two
    assert s.committable() == {0: 0} and s.held == 3
    assert feed(s, [ep("b", 1)], start=3) == ["complete"]
    (d,) = s.take_decisions(now=1, latest_version=0)
    assert d.kind == "batch" and d.episode_ids == ["a/0", "a/1", "b/0", "b/1"] and sorted(d.offsets) == [0, 1, 2, 3]
    assert d.batch is not None and d.batch.batch_id and d.group_ids == ["a", "b"]
    assert s.committable() == {0: 0}  # not acknowledged yet: nothing committable
    s.ack(d)
    assert s.committable() == {0: 4} and s.held == 0
    assert s.counters["batches"] == 1 and s.counters["batched_episodes"] == 4


def test_committable_is_lowest_held_offset():
    s = BufferState(cfg(groups_per_batch=1))
    feed(s, [ep("a", 0), ep("b", 0), ep("b", 1), ep("c", 0)])
    (d,) = s.take_decisions(now=0, latest_version=0)
    assert d.group_ids == ["b"]
    s.ack(d)
    assert s.committable() == {0: 0}  # a/0 at offset 0 still pending
    feed(s, [ep("a", 1)], start=4)
    ack_all(s, s.take_decisions(now=0, latest_version=0))
    assert s.committable() == {0: 3}  # c/0 at offset 3 still pending


def test_dedup_held_is_duplicate_and_decided_is_skipped():
    s = BufferState(cfg(groups_per_batch=1))
    assert feed(s, [ep("a", 0), ep("a", 0)]) == ["pending", "duplicate"]
    (dup,) = s.take_decisions(now=0, latest_version=0)
    assert dup.kind == "drop" and dup.reason == Reason.DUPLICATE and dup.offsets == [1]
    s.ack(dup)
    feed(s, [ep("a", 1)], start=2)
    (d,) = s.take_decisions(now=0, latest_version=0)
    assert d.episode_ids == ["a/0", "a/1"]  # the duplicate did not displace the original
    s.ack(d)
    # a replay after recovery (or a very late duplicate) of decided episodes: skipped, no new decision
    assert feed(s, [ep("a", 0), ep("a", 1)], start=0) == ["already_decided"] * 2
    assert s.take_decisions(now=0, latest_version=0) == [] and s.committable() == {0: 3}
    assert s.counters["already_decided"] == 2 and s.counters["dropped_duplicate"] == 1


def test_incomplete_group_timeout_drop_then_late_straggler():
    s = BufferState(cfg(group_timeout_s=5.0))
    feed(s, [ep("a", 0, size=3), ep("a", 1, size=3)], now=0.0)
    assert s.take_decisions(now=4.9, latest_version=0) == []
    (d,) = s.take_decisions(now=5.0, latest_version=0)
    assert d.reason == Reason.INCOMPLETE and d.episode_ids == ["a/0", "a/1"] and s.pending_groups == 0
    s.ack(d)
    assert feed(s, [ep("a", 2, size=3)], start=2, now=6) == ["late"]
    (late,) = s.take_decisions(now=6, latest_version=0)
    assert late.reason == Reason.LATE and late.episode_ids == ["a/2"]
    s.ack(late)
    assert s.committable() == {0: 3}


def test_incomplete_group_completed_by_policy():
    s = BufferState(cfg(group_timeout_s=5.0, incomplete_policy="complete", groups_per_batch=1))
    feed(s, [ep("a", 0, size=4), ep("a", 1, size=4)], now=0.0)
    (d,) = s.take_decisions(now=6, latest_version=0)
    assert d.kind == "batch" and d.episode_ids == ["a/0", "a/1"]


def test_stale_and_zero_variance_drops_are_decisions():
    s = BufferState(cfg(max_policy_lag=1, groups_per_batch=1))
    feed(s, [ep("old", 0, version=1), ep("old", 1, version=1), ep("flat", 0, reward=1.0, version=3),
                ep("flat", 1, reward=1.0, version=2)])
    ds = s.take_decisions(now=0, latest_version=3)
    assert sorted((d.reason, tuple(d.episode_ids)) for d in ds) == [
        (Reason.STALE, ("old/0", "old/1")), (Reason.ZERO_VARIANCE, ("flat/0", "flat/1"))]
    ack_all(s, ds)
    assert s.counters["dropped_stale"] == 2 and s.counters["dropped_zero_variance"] == 2
    assert s.committable() == {0: 4}


def test_partial_batch_after_wait_and_on_final():
    s = BufferState(cfg(groups_per_batch=4, max_batch_wait_s=3.0))
    feed(s, [ep("a", 0), ep("a", 1)], now=0)
    assert s.take_decisions(now=1, latest_version=0) == []
    (d,) = s.take_decisions(now=4, latest_version=0)
    assert d.group_ids == ["a"]
    feed(s, [ep("b", 0), ep("b", 1)], start=2, now=5)
    (d,) = s.take_decisions(now=5, latest_version=0, final=True)
    assert d.group_ids == ["b"]


def test_next_deadline_is_the_earliest_timer():
    s = BufferState(cfg(groups_per_batch=2, max_batch_wait_s=5.0, group_timeout_s=10.0))
    assert s.next_deadline() is None  # nothing held: no timer
    feed(s, [ep("a", 0)], now=1.0)  # pending group: its timeout
    s.take_decisions(now=1.0, latest_version=0)
    assert s.next_deadline() == 11.0
    feed(s, [ep("b", 0), ep("b", 1)], start=1, now=2.0)  # b scored, waiting for a second group
    s.take_decisions(now=2.0, latest_version=0)
    assert s.next_deadline() == 7.0
    (d,) = s.take_decisions(now=7.0, latest_version=0)  # the partial batch is due then
    assert d.group_ids == ["b"] and s.next_deadline() == 11.0


def test_batches_stay_within_a_partition_and_are_deterministic():
    def run(order):
        s = BufferState(cfg())
        for p, gid, i, off in order:
            s.add(ep(gid, i), partition=p, offset=off, now=0)
        return sorted((d.partition, d.batch.batch_id) for d in s.take_decisions(now=0, latest_version=0, final=True))

    p0 = [(0, "a", 0, 0), (0, "a", 1, 1), (0, "b", 0, 2), (0, "b", 1, 3)]
    p1 = [(1, "c", 0, 0), (1, "c", 1, 1), (1, "d", 0, 2), (1, "d", 1, 3)]
    interleaved = [x for pair in zip(p0, p1) for x in pair]
    assert run(p0 + p1) == run(p1 + p0) == run(interleaved)
    assert len(run(interleaved)) == 2


def test_revoke_forgets_partition():
    s = BufferState(cfg())
    feed(s, [ep("a", 0)], partition=0)
    feed(s, [ep("b", 0)], partition=1)
    s.revoke([0])
    assert s.committable() == {1: 0} and s.held == 1 and s.pending_groups == 1
    assert s.add(ep("a", 0), partition=0, offset=0, now=0) == "pending"  # the replay is not a duplicate


def test_a_group_waiting_for_its_batch_is_batched_after_a_revoke_not_dropped_late():
    """Scored but held back (the trainer is behind), then the partition is revoked: the replay from the committed
    offset forms the group again and batches it; a state saved meanwhile does not count it as decided either."""
    s = BufferState(cfg(groups_per_batch=1))
    feed(s, [ep("a", 0), ep("a", 1)])
    assert s.take_decisions(now=0, latest_version=0, max_batches=0) == [] and s.has_ready()
    assert "a" not in s.state_dict()["decided_groups"]
    s.revoke([0])
    assert feed(s, [ep("a", 0), ep("a", 1)]) == ["pending", "complete"]
    decisions = s.take_decisions(now=1, latest_version=0, max_batches=1)
    assert [(d.kind, d.episode_ids) for d in decisions] == [("batch", ["a/0", "a/1"])]


def test_state_dict_round_trip_keeps_decided_set():
    s = BufferState(cfg(groups_per_batch=1))
    feed(s, [ep("a", 0), ep("a", 1)])
    ack_all(s, s.take_decisions(now=0, latest_version=0))
    sd = s.state_dict()
    t = BufferState(cfg(groups_per_batch=1))
    t.load_state_dict(sd)
    assert t.is_decided("a/0") and t.committable() == {0: 2} and t.counters == s.counters
    assert t.add(ep("a", 1), partition=0, offset=1, now=0) == "already_decided"
    assert t.add(ep("a", 2, size=2), partition=0, offset=2, now=0) == "late"


def test_remember_decided_from_recovery_and_dedup_window_is_bounded():
    s = BufferState(cfg(dedup_window=3))
    s.remember_decided(["x/0", "x/1"], ["x"])
    assert s.add(ep("x", 0), partition=0, offset=0, now=0) == "already_decided"
    s.remember_decided(["y/0", "y/1", "z/0"])
    assert not s.is_decided("x/0") and s.is_decided("z/0")


def test_replayed_decided_episodes_count_towards_completion():
    # before a crash: g/0 was dropped (overlong, say) and published; the rest of g was not batched yet
    s = BufferState(cfg(groups_per_batch=1))
    s.remember_decided(["g/0"])
    res = feed(s, [ep("g", 0, size=3), ep("g", 1, size=3), ep("g", 2, size=3)])
    assert res == ["already_decided", "pending", "complete"]
    (d,) = s.take_decisions(now=0, latest_version=0)
    assert d.kind == "batch" and d.episode_ids == ["g/1", "g/2"] and sorted(d.offsets) == [1, 2]
    # a group whose every episode was decided is forgotten, without a decision
    s.remember_decided(["h/0", "h/1"])
    feed(s, [ep("h", 0), ep("h", 1)], start=3)
    s.ack(d)
    assert s.take_decisions(now=100, latest_version=0) == [] and s.groups == {} and s.committable() == {0: 5}


def test_trainer_behind_caps_batches_and_rechecks_staleness_of_waiting_groups():
    s = BufferState(cfg(groups_per_batch=1, max_policy_lag=1))
    feed(s, [ep("a", 0, version=0), ep("a", 1, version=0), ep("b", 0, version=1), ep("b", 1, version=1),
             ep("c", 0, version=1), ep("c", 1, version=1)])
    (d,) = s.take_decisions(now=0, latest_version=1, max_batches=1)
    assert d.group_ids == ["a"]
    assert s.take_decisions(now=50, latest_version=1, max_batches=0) == []  # b, c wait, held
    assert s.held == 6 and s.committable() == {0: 0}
    s.ack(d)
    # the policy moved on while they waited: version 1 is now older than 3 - 1
    ds = s.take_decisions(now=51, latest_version=3, max_batches=0)
    assert sorted((x.reason, tuple(x.episode_ids)) for x in ds) == [
        (Reason.STALE, ("b/0", "b/1")), (Reason.STALE, ("c/0", "c/1"))]
    ack_all(s, ds)
    assert s.held == 0 and s.committable() == {0: 6}


def test_waiting_group_partly_stale_is_rescored():
    s = BufferState(cfg(groups_per_batch=1, max_policy_lag=0, filter_zero_variance=False))
    e = [ep("g", 0, size=3, version=2, reward=1.0), ep("g", 1, size=3, version=3, reward=0.0),
         ep("g", 2, size=3, version=3, reward=1.0)]
    feed(s, e)
    assert s.take_decisions(now=0, latest_version=2, max_batches=0) == []
    stale, batch = s.take_decisions(now=0, latest_version=3, max_batches=1)
    assert stale.reason == Reason.STALE and stale.episode_ids == ["g/0"]
    assert batch.episode_ids == ["g/1", "g/2"] and batch.batch.advantages.tolist()[0] < 0 < batch.batch.advantages[1]


def test_replay_without_recovery_reforms_the_same_batch_ids():
    records = [ep(g, i) for g in "abcdef" for i in range(2)]
    s = BufferState(cfg())
    feed(s, records)
    first = s.take_decisions(now=0, latest_version=0)
    assert [d.group_ids for d in first] == [["a", "b"], ["c", "d"], ["e", "f"]]
    s.ack(first[0])  # crash: c..f published (maybe) but not acknowledged; offsets 4.. not committed
    committed = s.committable()[0]
    assert committed == 4
    t = BufferState(cfg())  # a successor that knows nothing
    feed(t, records[committed:], start=committed)
    again = t.take_decisions(now=0, latest_version=0)
    assert [d.batch.batch_id for d in again] == [d.batch.batch_id for d in first[1:]]


def test_fencing_applies_at_scoring_and_to_waiting_groups():
    def gen_ep(gid, i, gen, version):
        e = ep(gid, i, version=version)
        e.generator_id = gen
        return e

    s = BufferState(cfg(groups_per_batch=1, max_policy_lag=5))
    feed(s, [gen_ep("a", 0, "x", 2), gen_ep("a", 1, "x", 2), gen_ep("b", 0, "y", 2), gen_ep("b", 1, "y", 2)])
    ds = s.take_decisions(now=0, latest_version=2, fenced={"x": 1}, max_batches=0)
    assert [(d.reason, d.episode_ids) for d in ds] == [(Reason.FENCED, ["a/0", "a/1"])]
    # b waits for the trainer; then y is fenced too: its waiting group is re-checked
    ds = s.take_decisions(now=1, latest_version=2, fenced={"x": 1, "y": 1}, max_batches=0)
    assert [(d.reason, d.episode_ids) for d in ds] == [(Reason.FENCED, ["b/0", "b/1"])]


def test_rollout_reward_counts_zero_variance_groups_not_stale_ones():
    """Rule 11: the next batch carries the mean raw reward of every rollout scored since the previous one."""
    s = BufferState(cfg(max_policy_lag=1, groups_per_batch=1))
    feed(s, [ep("solved", 0, reward=1.0, version=3), ep("solved", 1, reward=1.0, version=3),
             ep("old", 0, reward=0.0, version=1), ep("old", 1, reward=0.0, version=1),
             ep("mixed", 0, reward=0.0, version=3), ep("mixed", 1, reward=1.0, version=3)])
    ds = s.take_decisions(now=0, latest_version=3)
    (b,) = [d.batch for d in ds if d.kind == "batch"]
    assert b.stats["rollout/episodes"] == 4.0 and b.stats["rollout/reward_mean"] == 0.75
    assert float(b.rewards.mean()) == 0.5  # the trained episodes alone: biased by the filter
    ack_all(s, ds)
    feed(s, [ep("next", 0, reward=0.0, version=3), ep("next", 1, reward=1.0, version=3)], start=6)
    (d,) = s.take_decisions(now=1, latest_version=3)
    assert d.batch.stats["rollout/episodes"] == 2.0 and d.batch.stats["rollout/reward_mean"] == 0.5  # reset


def test_each_cut_batch_is_checked_against_the_lag_it_will_have():
    """``future_versions``: the j-th batch cut now is trained after f(j) more versions at most, so its episodes may
    lag the reference by max_policy_lag - f(j) only (staleness.max_versions holds at training)."""
    s = BufferState(cfg(groups_per_batch=1, max_policy_lag=2))
    feed(s, [ep("old", 0, version=3), ep("old", 1, version=3), ep("new", 0, version=4), ep("new", 1, version=4)])
    decisions = s.take_decisions(now=0, latest_version=5, max_batches=2, future_versions=lambda j: j)
    # first cut (0 queued): lag 2, both groups fit; cut one at a time, the second (1 queued) allows lag 1: v3 is stale
    kinds = [(d.kind, d.group_ids if d.kind == "batch" else d.episode_ids, d.reason) for d in decisions]
    assert kinds[0] == ("batch", ["old"], "")
    assert ("batch", ["new"], "") in kinds and all(d.kind == "batch" for d in decisions)
    s2 = BufferState(cfg(groups_per_batch=1, max_policy_lag=2))
    feed(s2, [ep("old", 0, version=3), ep("old", 1, version=3), ep("new", 0, version=4), ep("new", 1, version=4)])
    decisions = s2.take_decisions(now=0, latest_version=4, max_batches=1, future_versions=lambda j: 1 + j,
                                  reference_version=5)  # one batch queued; the trainer's version 5 in flight
    assert [(d.kind, d.reason) for d in decisions] == [("drop", Reason.STALE), ("batch", "")]
    assert decisions[0].episode_ids == ["old/0", "old/1"] and decisions[1].group_ids == ["new"]


def test_future_versions_follow_the_trainers_progress():
    """The buffer's count of the versions a trainer may still publish before a batch cut now trains."""
    from buffer.pace import TrainerPace
    from topics.schemas import TrainerProgress

    pace = TrainerPace()
    pace.latest_version, pace.trained_steps, pace.published_step = 7, 10, 9
    f, ref = pace.future_versions(1)
    assert ref == 7 and [f(j) for j in range(3)] == [2, 3, 4]  # no progress: one per batch, one owed
    pace.progress = TrainerProgress(step=10, version=8, published_step=10, publish_every=1)
    f, ref = pace.future_versions(1)
    assert ref == 8 and [f(j) for j in range(3)] == [1, 2, 3]  # version 8 in flight already counts in ref
    pace.progress = TrainerProgress(step=11, version=8, published_step=10, publish_every=2)
    f, ref = pace.future_versions(1)
    assert [f(j) for j in range(4)] == [1, 1, 2, 2]  # a version per two steps: 1 unpublished + queued
    pace._seen.extend([(0, 0), (40, 10)])  # publish_busy skip: a version per four steps seen
    pace.progress = TrainerProgress(step=11, version=8, published_step=11, publish_every=1)
    f, _ = pace.future_versions(2)
    assert [f(j) for j in range(4)] == [1, 1, 1, 2]  # ceil(steps x 0.25): the rate seen, not one a step



def test_a_batch_records_where_each_episode_was_read():
    """Provenance: ``Batch.episode_partitions``/``episode_offsets`` name each episode's record, row by row."""
    s = BufferState(cfg())
    feed(s, [ep("b", 1), ep("a", 0)], partition=3, start=10)
    feed(s, [ep("b", 0), ep("a", 1)], partition=3, start=20)
    (d,) = s.take_decisions(now=1, latest_version=0)
    where = {"b/1": 10, "a/0": 11, "b/0": 20, "a/1": 21}
    assert d.batch.episode_partitions.tolist() == [3, 3, 3, 3]
    assert d.batch.episode_offsets.tolist() == [where[e] for e in d.batch.episode_ids]
