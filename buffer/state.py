"""The replay buffer's state machine, without any broker or clock of its own (time is passed in).

Time (``now``) is whatever monotonic clock the caller uses; it must never go back between calls.

An episode record moves through these states::

    received --add--> PENDING (in its group) --n distinct episodes--> COMPLETE --take_decisions--> verdict
    verdict: in a batch (accumulating per partition) | dropped(reason)  --> IN FLIGHT (a Decision)
    IN FLIGHT --ack(decision) after the broker acknowledged it--> DECIDED (offset released, id remembered)

Rules:

1. Deduplication by ``episode_id``. A record whose episode is already DECIDED (a replay after a crash or a
   rebalance, or a very late duplicate) is skipped: no new decision, its offset is released at once, counted as
   ``already_decided``; it still counts towards its pending group's completion (so a group some of whose
   episodes were dropped before a crash completes on replay). A record whose episode is still held (pending,
   complete, accumulating or in flight) is a duplicate: it gets its own ``duplicate`` drop decision.
2. A record for a group that is already DECIDED, whose episode is not, is dropped as ``late``.
3. A group is COMPLETE when it holds ``group_size`` distinct episodes (the size the first episode declared),
   counting its already-decided ones. A group with no live episode left is forgotten without a decision.
4. A PENDING group older than ``group_timeout_s`` (since its first episode) is, by ``incomplete_policy``, dropped
   as ``incomplete`` or completed with what arrived.
5. A COMPLETE group is scored when decisions are taken, with the latest policy version and fencing record known
   then (``buffer/policies.py``: overlong, fenced and stale episodes dropped, a zero-variance remainder dropped,
   advantages).
6. Scored groups accumulate per partition in completion order; ``plan_batches`` cuts full batches from them. A
   partial batch is published once its oldest group waited ``max_batch_wait_s``, or on ``final`` (drain).
   A batch holds groups of one partition only, so replaying a partition re-forms the same batches whenever the
   same groups complete in the same order (see ``buffer/service.py`` for crash recovery). A batch records the
   partition and offset each of its episodes was read from (``Batch.episode_offsets``, for provenance).
7. The trainer may be behind: ``take_decisions(max_batches=k)`` cuts at most ``k`` batches; the other scored
   groups wait (held, so the cap of rule 9 eventually stops consumption) and are checked again whenever the
   latest policy version or the fencing record changes: episodes that became stale (or fenced) meanwhile are
   dropped with that reason, and the rest of their group re-scored (zero-variance remainder dropped, advantages
   recomputed). With ``future_versions`` (``f(j)``: how many versions the trainer may still publish before the
   ``j``-th batch cut now is trained, ``buffer/service.py`` computes it from the trainer's progress) and the
   trainer's current version as ``reference_version``, each batch's groups are checked just before it is cut with
   the lag ``max_policy_lag - f(j)`` (at least 0) against that reference: no episode in it is more than
   ``max_policy_lag`` versions behind the version that trains it.
8. Offsets: every record's offset is held from ``add`` until its decision is acknowledged (skipped records are
   released at once). ``committable()`` gives, per partition, the lowest held offset, or one past the highest
   offset seen when nothing is held: the next offset a restarted consumer must read so nothing is lost.
9. Bounded memory: ``held`` counts the records held; the service stops fetching above ``max_pending_episodes``.
   The decided-id memory is an LRU window of ``dedup_window`` ids.
10. ``revoke(partitions)`` forgets everything held for those partitions (their new owner replays them).

11. What the policy achieves: the raw rewards of every group scored since the partition's previous batch (kept,
    zero-variance, overlong; not stale or fenced, whose weights are old) are averaged into the next batch's
    ``stats["rollout/reward_mean"]`` and ``stats["rollout/episodes"]``. With zero-variance filtering the kept
    episodes' own mean is biased towards 0.5; the trainer reports this one as ``reward_mean``.
12. Multi-turn episodes: every batch carries ``stats["env/restarts"]``, the environment restarts of every
    episode this buffer took so far (``Episode.env_restarts``), beside its own ``env/turns_mean`` and
    ``env/tool_calls_mean`` (``buffer/policies.py``); the trainer copies them into its metrics rows.

``state_dict()`` holds what Kafka cannot replay: the decided ids and groups, the positions and the counters.
Held episodes are not in it: they are beyond the committed offset and come back by replay.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from buffer.config import BufferConfig
from buffer.policies import Reason, ScoredGroup, build_batch, is_fenced, is_stale, plan_batches, score_group
from topics.schemas import Batch, Episode

BATCHED = "batched"
_OLD_POLICY = (Reason.STALE, Reason.FENCED)  # drops that say nothing of the current policy's reward


@dataclass(slots=True)
class Held:
    """One held record: where it came from and what to link spans to."""

    episode: Episode
    partition: int
    offset: int
    context: Any = None


@dataclass(slots=True)
class Group:
    group_id: str
    partition: int
    size: int
    first_seen: float
    members: dict[str, Held] = field(default_factory=dict)
    decided: set[str] = field(default_factory=set)  # its episodes that were decided before (replays)
    complete: bool = False

    @property
    def count(self) -> int:
        return len(self.members) + len(self.decided)


@dataclass(slots=True)
class Decision:
    """A batch or a drop to publish; ``ack`` it once the broker acknowledged the publish."""

    kind: str  # "batch" | "drop"
    partition: int
    episode_ids: list[str]
    offsets: list[int]
    group_ids: list[str]
    reason: str = ""  # drop reason
    detail: str = ""
    batch: Batch | None = None
    contexts: list[Any] = field(default_factory=list)

    @property
    def group_id(self) -> str:
        return self.group_ids[0] if self.group_ids else ""


@dataclass(slots=True)
class _Partition:
    next_offset: int = 0  # one past the highest offset seen
    held: set[int] = field(default_factory=set)
    ready: list[ScoredGroup] = field(default_factory=list)  # scored groups waiting for a batch
    ready_since: float = 0.0
    ready_held: dict[str, list[Held]] = field(default_factory=dict)  # group id -> its held records
    rollout_reward: float = 0.0  # raw rewards of the rollouts scored since the last batch (rule 11)
    rollouts: int = 0


class BufferState:
    """Groups, verdicts, batches and offsets of one buffer process (rules in the module docstring)."""

    def __init__(self, cfg: BufferConfig, *, buffer_id: str = "") -> None:
        self.cfg = cfg
        self.buffer_id = buffer_id
        self.groups: dict[str, Group] = {}
        self.parts: dict[int, _Partition] = {}
        self._complete_order: list[str] = []
        self._outbox: list[Decision] = []
        self._decided: OrderedDict[str, None] = OrderedDict()
        self._decided_groups: OrderedDict[str, str] = OrderedDict()  # group id -> "batched" or a drop reason
        self._held_ids: set[str] = set()
        self._checked: tuple[int | None, dict[str, int]] = (None, {})  # what waiting groups were checked against
        self._fenced: dict[str, int] = {}
        self.counters: dict[str, int] = {"received": 0, "batches": 0, "batched_episodes": 0, "already_decided": 0}

    # -- queries ------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Records held in memory (pending, complete, accumulating or in flight)."""
        return sum(len(p.held) for p in self.parts.values())

    @property
    def pending_groups(self) -> int:
        return sum(1 for g in self.groups.values() if not g.complete)

    def is_decided(self, episode_id: str) -> bool:
        return episode_id in self._decided

    def next_deadline(self) -> float | None:
        """The earliest time a timer rule (4, 6) may decide something: the oldest pending group's timeout or a
        partition's partial-batch wait; None when neither is running. Valid after ``take_decisions``, which
        removes complete groups from ``groups`` (so its first, oldest group is pending)."""
        times = [p.ready_since + self.cfg.max_batch_wait_s for p in self.parts.values() if p.ready]
        oldest = next(iter(self.groups.values()), None)
        if oldest is not None:
            times.append(oldest.first_seen + self.cfg.group_timeout_s)
        return min(times, default=None)

    def committable(self) -> dict[int, int]:
        """Per partition: the next offset a restarted consumer must read (rule 8)."""
        return {p: (min(t.held) if t.held else t.next_offset) for p, t in self.parts.items()}

    # -- input --------------------------------------------------------------------------------
    def _part(self, partition: int) -> _Partition:
        part = self.parts.get(partition)
        if part is None:
            part = self.parts[partition] = _Partition()
        return part

    def _see(self, partition: int, offset: int) -> _Partition:
        part = self._part(partition)
        part.next_offset = max(part.next_offset, offset + 1)
        return part

    def add(self, ep: Episode, *, partition: int, offset: int, now: float, context: Any = None) -> str:
        """Take one decoded record; returns ``pending``, ``complete``, ``already_decided``, ``duplicate``, ``late``."""
        part = self._see(partition, offset)
        self.counters["received"] += 1
        if ep.episode_id in self._decided:
            self.counters["already_decided"] += 1
            group = self.groups.get(ep.group_id)
            if group is None and ep.group_id not in self._decided_groups:
                group = self.groups[ep.group_id] = Group(ep.group_id, partition, ep.group_size, now)
            if group is not None and not group.complete:
                group.decided.add(ep.episode_id)
                self._check_complete(group)
            return "already_decided"
        held = Held(ep, partition, offset, context)
        if ep.episode_id in self._held_ids:
            part.held.add(offset)
            self._outbox.append(self._drop([held], Reason.DUPLICATE, ep.group_id, "episode already held"))
            return "duplicate"
        if ep.group_id in self._decided_groups:
            part.held.add(offset)
            self._held_ids.add(ep.episode_id)  # a redelivery while this drop is in flight is a duplicate
            self._outbox.append(self._drop(
                [held], Reason.LATE, ep.group_id, f"group already {self._decided_groups[ep.group_id]}"))
            return "late"
        group = self.groups.get(ep.group_id)
        if group is None:
            group = self.groups[ep.group_id] = Group(ep.group_id, partition, ep.group_size, now)
        part.held.add(offset)
        self._held_ids.add(ep.episode_id)
        group.members[ep.episode_id] = held
        if ep.env_restarts:  # env/restarts on every batch: the restarts of every episode taken so far
            self.counters["env_restarts"] = self.counters.get("env_restarts", 0) + ep.env_restarts
        return "complete" if self._check_complete(group) else "pending"

    def _check_complete(self, group: Group) -> bool:
        if group.count >= group.size and not group.complete:
            group.complete = True
            self._complete_order.append(group.group_id)
            return True
        return False

    def skip(self, partition: int, offset: int) -> None:
        """A record handled elsewhere (dead-lettered and acknowledged): advance the position only."""
        self._see(partition, offset)

    def remember_decided(self, episode_ids: Iterable[str], group_ids: Iterable[str] = (), *,
                         outcome: str = BATCHED) -> None:
        """Mark ids and groups DECIDED without a decision of ours (crash recovery from the output topics)."""
        for eid in episode_ids:
            self._remember(eid)
        for gid in group_ids:
            self._remember_group(gid, outcome)

    # -- decisions ----------------------------------------------------------------------------
    def take_decisions(self, *, now: float, latest_version: int | None, final: bool = False,
                       max_batches: int | None = None, fenced: Mapping[str, int] | None = None,
                       future_versions: Callable[[int], int] | None = None,
                       reference_version: int | None = None) -> list[Decision]:
        """Expire, score and batch (rules 4-7); every returned decision is IN FLIGHT until ``ack``.

        ``max_batches`` caps the batches cut now (the trainer is behind); groups then wait, scored, and are
        checked for staleness again whenever the latest version moves. ``future_versions`` and
        ``reference_version`` (default ``latest_version``): each cut batch is checked against the lag it will have
        when trained (rule 7). ``fenced`` maps fenced generator ids to the last version they acknowledged (``policies.is_fenced``).
        """
        self._fenced = dict(fenced or {})
        self._expire(now)
        for gid in self._complete_order:
            group = self.groups.pop(gid, None)
            if group is not None:
                self._score(group, now, latest_version)
        self._complete_order.clear()
        if (latest_version, self._fenced) != self._checked:
            self._checked = (latest_version, dict(self._fenced))
            for part in self.parts.values():
                self._recheck_stale(part, latest_version, self.cfg.max_policy_lag)
        budget = max_batches
        reference = latest_version if reference_version is None else reference_version
        cut = 0
        for partition, part in sorted(self.parts.items(), key=lambda kv: kv[1].ready_since):
            while part.ready and budget != 0:
                if future_versions is not None:  # check this batch with the lag it will have when trained
                    lag = max(0, self.cfg.max_policy_lag - future_versions(cut))
                    self._recheck_stale(part, reference, lag)
                    if not part.ready:
                        break
                flush = final or now - part.ready_since >= self.cfg.max_batch_wait_s
                batches, remainder = plan_batches(
                    part.ready, groups_per_batch=self.cfg.groups_per_batch, token_budget=self.cfg.token_budget,
                    budget_count=self.cfg.budget_count, final=flush,
                )
                if not batches:
                    break
                if budget is not None or future_versions is not None:  # one at a time: each has its own lag
                    remainder = [g for b in batches[1:] for g in b] + remainder
                    batches = batches[:1]
                    budget = None if budget is None else budget - 1
                    cut += 1
                for groups in batches:
                    self._outbox.append(self._batch(partition, part, groups))
                part.ready = remainder
                part.ready_since = now
        out, self._outbox = self._outbox, []
        return out

    def has_ready(self) -> bool:
        """Whether scored groups wait for a batch (rule 6), e.g. held back by the trainer being behind."""
        return any(part.ready for part in self.parts.values())

    def ack(self, decision: Decision) -> None:
        """The decision's publish was acknowledged: release its offsets, remember its ids (DECIDED)."""
        part = self.parts.get(decision.partition)
        if part is not None:  # None: the partition was revoked meanwhile; its new owner replays it
            part.held.difference_update(decision.offsets)
        if decision.kind == "batch":
            self.counters["batches"] += 1
            self.counters["batched_episodes"] += len(decision.episode_ids)
        else:
            key = f"dropped_{decision.reason}"
            self.counters[key] = self.counters.get(key, 0) + len(decision.episode_ids)
        if decision.reason == Reason.DUPLICATE:
            return  # the original record is decided by its own decision
        for eid in decision.episode_ids:
            self._held_ids.discard(eid)
            self._remember(eid)

    def revoke(self, partitions: Iterable[int]) -> None:
        """Forget everything held for these partitions (rule 10)."""
        gone = set(partitions)
        for gid in [g.group_id for g in self.groups.values() if g.partition in gone]:
            for eid in self.groups.pop(gid).members:
                self._held_ids.discard(eid)
        self._complete_order = [g for g in self._complete_order if g in self.groups]
        for p in gone:
            part = self.parts.pop(p, None)
            if part is not None:
                for gid, members in part.ready_held.items():
                    # scored but never published: undecided, so its replay must form the group again, not be
                    # dropped as ``late``
                    self._decided_groups.pop(gid, None)
                    for h in members:
                        self._held_ids.discard(h.episode.episode_id)

    # -- internals ----------------------------------------------------------------------------
    def _remember(self, eid: str) -> None:
        self._decided[eid] = None
        self._decided.move_to_end(eid)
        while len(self._decided) > self.cfg.dedup_window:
            self._decided.popitem(last=False)

    def _remember_group(self, gid: str, outcome: str) -> None:
        if gid in self._decided_groups and outcome != BATCHED:
            return  # a group partly batched stays "batched"
        self._decided_groups[gid] = outcome
        self._decided_groups.move_to_end(gid)
        while len(self._decided_groups) > self.cfg.dedup_window:
            self._decided_groups.popitem(last=False)

    def _drop(self, members: list[Held], reason: str, group_id: str, detail: str = "") -> Decision:
        partition = members[0].partition if members else -1
        return Decision(
            kind="drop", partition=partition, episode_ids=[h.episode.episode_id for h in members],
            offsets=[h.offset for h in members], group_ids=[group_id], reason=reason, detail=detail,
            contexts=[h.context for h in members if h.context is not None],
        )

    def _expire(self, now: float) -> None:
        # ``groups`` is in creation order, i.e. by ``first_seen`` (time never goes back): stop at the first young one
        expired = []
        for g in self.groups.values():
            if now - g.first_seen < self.cfg.group_timeout_s:
                break
            if not g.complete:
                expired.append(g)
        for group in expired:
            if not group.members:  # only replays of decided episodes: nothing left to decide
                del self.groups[group.group_id]
            elif self.cfg.incomplete_policy == "complete":
                group.complete = True
                self._complete_order.append(group.group_id)
            else:
                del self.groups[group.group_id]
                members = sorted(group.members.values(), key=lambda h: h.episode.episode_id)
                self._remember_group(group.group_id, Reason.INCOMPLETE)
                self._outbox.append(self._drop(
                    members, Reason.INCOMPLETE, group.group_id,
                    f"{len(members)} of {group.size} episodes after {self.cfg.group_timeout_s:g} s"))

    def _score(self, group: Group, now: float, latest_version: int | None) -> None:
        c = self.cfg
        if not group.members:  # every episode was decided before (a replay): nothing to do
            return
        verdict = score_group(
            group.group_id, [h.episode for h in group.members.values()], latest_version=latest_version,
            max_policy_lag=c.max_policy_lag, max_response_tokens=c.max_response_tokens,
            filter_truncated=c.filter_truncated, filter_zero_variance=c.filter_zero_variance,
            advantage=c.advantage, advantage_eps=c.advantage_eps, reward_scale=c.reward_scale,
            reward_clip=c.reward_clip, partition=group.partition, fenced=self._fenced,
        )
        for reason, ids in verdict.dropped.items():
            detail = f"latest version {latest_version}" if reason == Reason.STALE else ""
            self._outbox.append(self._drop([group.members[e] for e in ids], reason, group.group_id, detail))
        self._remember_group(group.group_id, BATCHED if verdict.kept else next(iter(verdict.dropped), "dropped"))
        part = self._part(group.partition)
        rolled = [group.members[e].episode for r, ids in verdict.dropped.items() if r not in _OLD_POLICY for e in ids]
        rolled += verdict.kept.episodes if verdict.kept is not None else []
        part.rollout_reward += sum(e.reward for e in rolled)
        part.rollouts += len(rolled)
        if verdict.kept is None:
            return
        if not part.ready:
            part.ready_since = now
        part.ready.append(verdict.kept)
        part.ready_held[group.group_id] = [group.members[e] for e in verdict.kept.episode_ids]

    def _recheck_stale(self, part: _Partition, latest_version: int | None, lag: int) -> None:
        """Groups waiting for a batch are re-scored when episodes in them became stale (more than ``lag``
        versions behind) or fenced (rule 7)."""
        c = self.cfg
        keep: list[ScoredGroup] = []
        for g in part.ready:
            if not any(is_stale(e, latest_version, lag) or is_fenced(e, self._fenced) for e in g.episodes):
                keep.append(g)
                continue
            members = {h.episode.episode_id: h for h in part.ready_held.pop(g.group_id)}
            verdict = score_group(
                g.group_id, g.episodes, latest_version=latest_version, max_policy_lag=lag,
                filter_zero_variance=c.filter_zero_variance, advantage=c.advantage, advantage_eps=c.advantage_eps,
                reward_scale=c.reward_scale, reward_clip=c.reward_clip, partition=g.partition, fenced=self._fenced,
            )
            for reason, ids in verdict.dropped.items():
                detail = f"latest version {latest_version}, lag {lag} (while waiting for the trainer)"
                self._outbox.append(self._drop([members[e] for e in ids], reason, g.group_id, detail))
            if verdict.kept is not None:
                keep.append(verdict.kept)
                part.ready_held[g.group_id] = [members[e] for e in verdict.kept.episode_ids]
        part.ready = keep

    def _batch(self, partition: int, part: _Partition, groups: list[ScoredGroup]) -> Decision:
        batch = build_batch(groups, pad_token_id=self.cfg.pad_token_id, pad_to_multiple=self.cfg.pad_to_multiple,
                            buffer_id=self.buffer_id,
                            pack_row_tokens=self.cfg.pack_row_tokens if self.cfg.batching == "pack" else None)
        held = [h for g in groups for h in part.ready_held.pop(g.group_id)]
        batch.episode_partitions = np.asarray([h.partition for h in held], dtype=np.int32)  # provenance
        batch.episode_offsets = np.asarray([h.offset for h in held], dtype=np.int64)
        if part.rollouts:  # rule 11
            batch.stats["rollout/reward_mean"] = part.rollout_reward / part.rollouts
            batch.stats["rollout/episodes"] = float(part.rollouts)
            part.rollout_reward, part.rollouts = 0.0, 0
        batch.stats["env/restarts"] = float(self.counters.get("env_restarts", 0))
        return Decision(
            kind="batch", partition=partition, episode_ids=batch.episode_ids, offsets=[h.offset for h in held],
            group_ids=[g.group_id for g in groups], batch=batch,
            contexts=[h.context for h in held if h.context is not None],
        )

    # -- persistence --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "decided": list(self._decided),
            # a group scored but waiting for a batch is not decided: its episodes come back by replay
            "decided_groups": {g: o for g, o in self._decided_groups.items()
                               if not any(g in part.ready_held for part in self.parts.values())},
            "positions": {str(p): t.next_offset for p, t in self.parts.items()},
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unknown buffer state version {state.get('version')!r}")
        self._decided = OrderedDict((e, None) for e in state["decided"])
        self._decided_groups = OrderedDict(state["decided_groups"])
        for p, off in state["positions"].items():
            self._part(int(p)).next_offset = int(off)
        self.counters = dict(state["counters"])
