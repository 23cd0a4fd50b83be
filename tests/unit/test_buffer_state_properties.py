"""Property test of the buffer state machine: whatever the interleaving, duplicates, timeouts, versions and
trainer limits, every episode is decided exactly once, committed offsets never go back, and all get released."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.config import BufferConfig
from buffer.policies import Reason
from buffer.state import BufferState
from topics.schemas import Episode


def episode(gid: str, i: int, size: int, reward: float, version: int, resp: int) -> Episode:
    return Episode(
        episode_id=f"{gid}/{i}", group_id=gid, group_size=size, prompt_id=gid,
        prompt_tokens=np.array([1, 2, 3], dtype=np.int32), response_tokens=np.full(resp, 7, dtype=np.int32),
        logprobs=np.full(resp, -0.1, dtype=np.float32), token_versions=np.full(resp, version, dtype=np.int32),
        policy_version=version, reward=reward,
    )


groups_st = st.lists(
    st.tuples(st.integers(1, 4), st.integers(0, 3), st.lists(st.sampled_from([0.0, 1.0]), min_size=4, max_size=4),
              st.integers(0, 4), st.integers(1, 6), st.integers(0, 4)),
    min_size=1, max_size=12,
)


@given(
    groups=groups_st,
    order_seed=st.integers(0, 2**16),
    dup_rate=st.sampled_from([0.0, 0.2]),
    cfg_kw=st.fixed_dictionaries({
        "groups_per_batch": st.integers(1, 3),
        "token_budget": st.sampled_from([0, 40]),
        "incomplete_policy": st.sampled_from(["drop", "complete"]),
        "max_response_tokens": st.sampled_from([0, 5]),
        "max_policy_lag": st.integers(0, 2),
        "filter_zero_variance": st.booleans(),
    }),
    max_batches=st.sampled_from([None, 0, 1]),
)
@settings(max_examples=100, deadline=None)
def test_every_episode_decided_once_and_offsets_monotone(groups, order_seed, dup_rate, cfg_kw, max_batches):
    rng = np.random.default_rng(order_seed)
    cfg = BufferConfig(group_timeout_s=5.0, max_batch_wait_s=3.0, **cfg_kw)
    s = BufferState(cfg)
    # build records: each group in one of 4 partitions; some groups lose an episode (never complete)
    per_part: dict[int, list[Episode]] = {p: [] for p in range(4)}
    produced: set[str] = set()
    for k, (size, part, rewards, version, resp, missing) in enumerate(groups):
        gid = f"g{k}"
        eps = [episode(gid, i, size, rewards[i], version, resp) for i in range(size)]
        if missing == 0 and size > 1:
            eps = eps[:-1]
        produced.update(e.episode_id for e in eps)
        per_part[part % 4].extend(eps)
    records = []
    for p, eps in per_part.items():
        order = list(rng.permutation(len(eps)))
        seq = [eps[i] for i in order]
        seq += [seq[i] for i in range(len(seq)) if rng.random() < dup_rate]  # redeliveries
        records += [(p, e) for e in seq]
    rng.shuffle(records)
    offsets = Counter()
    now, latest = 0.0, 0
    decisions, acked, last_commit = [], [], {}
    for p, e in records:
        s.add(e, partition=p, offset=offsets[p], now=now)
        offsets[p] += 1
        now += float(rng.choice([0.0, 0.5, 2.0]))
        if rng.random() < 0.3:
            latest += int(rng.integers(0, 2))
            decisions += s.take_decisions(now=now, latest_version=latest, max_batches=max_batches)
            while decisions and rng.random() < 0.7:  # acknowledgements arrive late, in order
                acked.append(decisions.pop(0))
                s.ack(acked[-1])
        for part, off in s.committable().items():
            assert off >= last_commit.get(part, 0), "a committed offset went back"
            assert off <= offsets[part]
            last_commit[part] = off
    # the end of the stream: timers expire, the trainer catches up, everything is published and acknowledged
    decisions += s.take_decisions(now=now + 100, latest_version=latest)
    decisions += s.take_decisions(now=now + 200, latest_version=latest, final=True)
    for d in decisions:
        s.ack(d)
    acked += decisions
    assert s.held == 0 and s.committable() == {p: n for p, n in offsets.items() if n}

    seen = Counter()
    for d in acked:
        if d.reason != Reason.DUPLICATE:
            seen.update(d.episode_ids)
    assert set(seen) == produced and all(n == 1 for n in seen.values()), seen.most_common(3)


@given(
    groups=groups_st,
    order_seed=st.integers(0, 2**16),
    crash_at=st.floats(0.1, 0.9),
    cfg_kw=st.fixed_dictionaries({
        "groups_per_batch": st.integers(1, 3),
        "incomplete_policy": st.sampled_from(["drop", "complete"]),
        "max_policy_lag": st.integers(0, 2),
    }),
)
@settings(max_examples=100, deadline=None)
def test_crash_then_recovery_from_outputs_decides_each_episode_once(groups, order_seed, crash_at, cfg_kw):
    """A buffer crashes with decisions in flight (each reached the topic or not); its successor learns what the
    topics hold (as ``buffer/recovery.py`` does), replays from the committed offsets and finishes the stream."""
    rng = np.random.default_rng(order_seed)
    cfg = BufferConfig(group_timeout_s=5.0, max_batch_wait_s=3.0, **cfg_kw)
    produced: set[str] = set()
    log: dict[int, list[Episode]] = {p: [] for p in range(4)}  # the episodes topic, per partition
    arrivals = []
    for k, (size, part, rewards, version, resp, missing) in enumerate(groups):
        eps = [episode(f"g{k}", i, size, rewards[i], version, resp) for i in range(size)]
        if missing == 0 and size > 1:
            eps = eps[:-1]
        produced.update(e.episode_id for e in eps)
        arrivals += [(part % 4, e) for e in eps]
    rng.shuffle(arrivals)
    for p, e in arrivals:
        log[p].append(e)
    order = [(p, i) for p in range(4) for i in range(len(log[p]))]
    order.sort(key=lambda pi: (pi[1], rng.random()))  # partitions interleaved, offsets in order
    crash = int(len(order) * crash_at)

    published = []  # what reached the topics
    a = BufferState(cfg)
    now = 0.0
    inflight = []
    for p, i in order[:crash]:
        a.add(log[p][i], partition=p, offset=i, now=now)
        now += float(rng.choice([0.0, 1.0, 3.0]))
        inflight += a.take_decisions(now=now, latest_version=0)
        while inflight and rng.random() < 0.5:
            d = inflight.pop(0)
            published.append(d)
            a.ack(d)
    committed = a.committable()
    published += [d for d in inflight if rng.random() < 0.5]  # sent before the crash, never acknowledged

    b = BufferState(cfg)  # the successor: recovery from the output topics
    for d in published:
        if d.reason == Reason.DUPLICATE:
            continue
        b.remember_decided(d.episode_ids, [d.group_id] if d.reason == Reason.INCOMPLETE else (),
                           outcome=Reason.INCOMPLETE)
    now += 1.0
    for p in range(4):
        for i in range(committed.get(p, 0), len(log[p])):
            b.add(log[p][i], partition=p, offset=i, now=now)
            now += float(rng.choice([0.0, 1.0]))
            published += b.take_decisions(now=now, latest_version=0)
    published += b.take_decisions(now=now + 100, latest_version=0)
    published += b.take_decisions(now=now + 200, latest_version=0, final=True)

    seen = Counter()
    for d in published:
        if d.reason != Reason.DUPLICATE:
            seen.update(d.episode_ids)
    assert set(seen) == produced, produced - set(seen)
    assert all(n == 1 for n in seen.values()), seen.most_common(3)
