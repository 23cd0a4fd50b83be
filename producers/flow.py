"""Pure bookkeeping of the generator's intake: which offsets may be committed, and when to stop taking prompts.

``OffsetTracker``: prompts of one partition finish out of order (concurrent generation), but a Kafka commit means
"everything before this offset is done". The tracker records each offset when taken and when done, and
``committable()`` returns, per partition, the next offset after the longest *contiguous* completed prefix, once
it moved past what was last committed. A generator killed mid-prompt therefore never commits past an unfinished
prompt: another generator of the group gets it again (at-least-once; episode ids are deterministic, so the
buffer deduplicates what was produced twice).

``Backpressure``: the generator takes a new prompt only while

* ``reference - engine_version <= max_policy_lag``: its weights are at most ``max_policy_lag`` versions older than
  the trainer's (the newest published PolicyVersion, or the trainer's own version from its progress when a
  publication is still in flight): what older weights sample would be too stale to train. It resumes when the
  weight receiver loads a newer version. Before any version is known this never throttles.
* and, when ``groups_per_step > 0`` (this generator's share of the groups the trainer trains per step),
  ``taken < floor((trained + window_steps) * groups_per_step + phase) + granted``: ``taken`` counts the prompts
  this generator took and ``trained`` the trainer steps since the generator started, in groups: the groups the
  trainer has trained since (``TrainerProgress.groups``, after every step) over ``groups_per_batch`` (the groups a
  full batch holds). So it holds at most ``window_steps`` full batches of groups beyond what the trainer has
  trained (AReaL's bounded off-policyness), also before the first version: a generator never floods a run whose
  trainer is still starting. Counted in groups, a batch the buffer cut short (``buffer.max_batch_wait_s``) opens
  the quota by the groups it trained, not by a whole batch: counted in steps, every short batch widened the window
  by the groups it lacked, and the surplus aged in the buffer until it was dropped as stale (a third of what the
  generator made on SmolLM2 at staleness 1). With no group count (``groups_per_batch`` 0, or a trainer that does
  not report it) ``trained`` is ``latest_step - start_step``: the trainer's step (its progress, or the step of the
  newest PolicyVersion) less the one in the store when the generator started (0 in a new run).
* The share may be fractional: with more generators than groups per batch (256 generators, 64 groups a batch:
  a quarter group a step each) a generator takes one group every four steps. ``phase`` (``quota_phase``, in
  [0, 1), from the generator's id) staggers when: the generators' phases are spread evenly, so the fleet's quotas
  add up to the window's groups within one group at every step, instead of every generator flooring to no group
  at all (only the liveness guard then let any through) or all of them taking their group at the same step.
* A group the buffer will drop for zero variance (every reward equal) trains nothing; with
  ``count_zero_variance=False`` the generator gives its quota back (``scored()``) once it has scored it, and a group
  the buffer dropped (stale, fenced, incomplete: ``producers/refunds.py``) gives it back when the drop is read
  (``refund()``), so the quota counts the groups that can train.

Liveness guard: if the buffer drops groups for another reason (stale, overlong, a restart's duplicates), the
trainer may need more groups than the quota lets through and would wait forever; so when the quota blocked intake
for ``stall_s()`` with nothing in flight and no new version, ``grant()`` adds one more step's worth. ``stall_s()``
is the configured ``backpressure_stall_s``, or, when that is 0, three times the mean interval between the last
published versions, times ``1 / groups_per_step`` when the share is under one group (a generator with a quarter
group a step waits four steps between its groups by design), at least 2 s; 30 s before two versions were seen,
while the trainer may still be loading.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Partition:
    committed: int  # next offset to read, as last committed (or -1: unknown, nothing committed by us)
    pending: set[int] = field(default_factory=set)  # taken, not yet done
    done: set[int] = field(default_factory=set)  # done, not yet part of the committed prefix
    low: int = -1  # smallest offset taken since the last commit point
    last: int = -1  # largest offset taken (records arrive in offset order per partition)


class OffsetTracker:
    """Per-partition contiguous-completion tracking; keys are any hashable partition ids (e.g. TopicPartition)."""

    def __init__(self) -> None:
        self._parts: dict[object, _Partition] = {}

    def take(self, tp: object, offset: int) -> None:
        part = self._parts.get(tp)
        if part is None:
            part = self._parts[tp] = _Partition(committed=-1)
        if part.committed >= 0 and offset < part.committed:
            return  # a redelivery of something already committed: nothing to track
        if 0 <= part.last < offset - 1:  # offsets the broker skipped (compaction, control records): nothing to do
            part.done.update(range(part.last + 1, offset))
        part.last = max(part.last, offset)
        part.pending.add(offset)
        if part.low < 0 or offset < part.low:
            part.low = offset

    def done(self, tp: object, offset: int) -> None:
        part = self._parts.get(tp)
        if part is None or offset not in part.pending:
            return  # partition revoked meanwhile, or already committed
        part.pending.discard(offset)
        part.done.add(offset)

    def committable(self) -> dict[object, int]:
        """``{tp: next_offset}`` for partitions whose contiguous done-prefix advanced (not yet committed)."""
        out = {}
        for tp, part in self._parts.items():
            if part.low < 0:
                continue
            nxt = max(part.committed, part.low)
            while nxt in part.done:
                nxt += 1
            if nxt > max(part.committed, part.low):
                out[tp] = nxt
        return out

    def committed(self, offsets: dict[object, int]) -> None:
        """Record a successful commit of ``offsets`` (from ``committable()``)."""
        for tp, nxt in offsets.items():
            part = self._parts.get(tp)
            if part is None:
                continue
            part.committed = nxt
            part.done = {o for o in part.done if o >= nxt}
            part.pending = {o for o in part.pending if o >= nxt}
            remaining = part.pending | part.done
            part.low = min(remaining) if remaining else nxt

    def forget(self, tps: object) -> None:
        """Drop partitions (revoked in a rebalance): their unfinished prompts belong to the new owner."""
        for tp in list(tps):  # type: ignore[call-overload]
            self._parts.pop(tp, None)

    def in_flight(self) -> int:
        return sum(len(p.pending) for p in self._parts.values())

    def pending(self, tp: object) -> set[int]:
        part = self._parts.get(tp)
        return set(part.pending) if part else set()


GOLDEN = (math.sqrt(5) - 1) / 2  # the Weyl sequence i * GOLDEN mod 1 spreads any run of indices evenly over [0, 1)


def quota_phase(generator_id: str) -> float:
    """The generator's offset in [0, 1) of its fractional quota (module docstring). An id ending in an index
    (``generator-3``, as ``up`` and the deploy examples name them) takes ``frac(i * GOLDEN)``: for generators
    0..N-1 the sum of ``floor(x + phase)`` stays within one of ``N * x`` (checked for N up to 1,000), and generator 0
    has phase 0 (a lone generator's quota is the plain floor). Any other id takes a phase from its CRC32 (even on average)."""
    index = re.search(r"(\d+)$", generator_id)
    if index:
        return (int(index.group(1)) * GOLDEN) % 1.0
    return (zlib.crc32(generator_id.encode()) & 0xFFFF) / 0x10000


@dataclass(slots=True)
class Backpressure:
    """See the module docstring. ``open`` says whether the generator may take another prompt now."""

    max_policy_lag: int
    groups_per_step: float = 0.0  # 0 = no quota
    window_steps: int = 2
    stall_s_config: float = 0.0  # 0 = adaptive (module docstring)
    count_zero_variance: bool = True
    phase: float = 0.0  # in [0, 1): where this generator's fractional quota steps up (``quota_phase``)
    start_step: int = 0  # the trainer step of the version in the store when this generator started
    groups_per_batch: int = 0  # groups in a full batch (the fleet's groups per step); 0 = count the quota in steps
    start_groups: int = 0  # the groups the trainer had trained when this generator started (-1 = not reported)
    latest_groups: int = -1  # the groups it has trained now (its progress), -1 before any report or not reported
    latest: int | None = None  # newest published version, None before the first
    latest_step: int = 0  # its trainer step
    trainer_version: int = -1  # the version the trainer trains with (its progress), -1 before any
    taken: int = 0  # prompts taken by this generator since it started (less the refunds)
    granted: int = 0  # extra prompts granted by the liveness guard
    refunded: int = 0  # zero-variance groups given back
    _seen_at: deque[float] = field(default_factory=lambda: deque(maxlen=6))  # when the last versions arrived

    def started_at(self, step: int, groups: int | None = None) -> None:
        """The generator starts while the store holds a version of trainer step ``step`` (a restart, a late join),
        and the trainer has trained ``groups`` groups (its progress; -1 = not reported, None = no progress yet)."""
        self.start_step = self.latest_step = max(0, step)
        if groups is None:  # no progress in the store: a new run counts from 0; a version without one, in steps
            groups = 0 if step <= 0 else -1
        self.start_groups = self.latest_groups = groups

    def published(self, version: int, step: int | None = None, now: float | None = None) -> None:
        if self.latest is None or version > self.latest:
            self.latest = version
            if now is not None:
                self._seen_at.append(now)
        if step is not None:
            self.latest_step = max(self.latest_step, step)

    def progressed(self, step: int, version: int | None = None, groups: int = -1) -> None:
        """The trainer has trained ``step`` steps (``groups`` groups, -1 if not reported) and trains with
        ``version`` now (its progress, after every step; the version counts a publication still in flight)."""
        self.latest_step = max(self.latest_step, step)
        if groups >= 0:
            self.latest_groups = max(self.latest_groups, groups)
        if version is not None:
            self.trainer_version = max(self.trainer_version, version)

    def took(self, n: int = 1) -> None:
        self.taken += n

    def scored(self, rewards: list[float]) -> None:
        """A group of this generator was scored: give its quota back if it cannot train (zero variance)."""
        if not self.count_zero_variance and (len(rewards) < 2 or max(rewards) - min(rewards) <= 1e-9):
            self.refund()

    def refund(self) -> None:
        """A group of this generator will train nothing (zero variance, or dropped by the buffer): its quota back."""
        self.taken -= 1
        self.refunded += 1

    def quota(self) -> int | None:
        """Prompts this generator may have taken by now (None: unlimited)."""
        if self.groups_per_step <= 0:
            return None
        return math.floor((self.trained() + self.window_steps) * self.groups_per_step + self.phase + 1e-9) + self.granted

    def trained(self) -> float:
        """Trainer steps since this generator started, counted in full batches of groups when the trainer
        reports its groups (module docstring), else in steps."""
        if self.groups_per_batch > 0 and self.start_groups >= 0 and self.latest_groups >= 0:
            return max(0, self.latest_groups - self.start_groups) / self.groups_per_batch
        return self.latest_step - self.start_step

    def stall_s(self) -> float:
        """How long the quota may block intake, with nothing in flight, before ``grant()`` (module docstring)."""
        if self.stall_s_config > 0:
            return self.stall_s_config
        seen = list(self._seen_at)
        if len(seen) < 2:
            return 30.0
        steps = 1.0 / self.groups_per_step if 0 < self.groups_per_step < 1 else 1.0  # between this one's groups
        return max(2.0, 3.0 * steps * (seen[-1] - seen[0]) / (len(seen) - 1))

    def reference(self) -> int | None:
        """The version the weights are compared with: the trainer's own when its progress says it is newer than
        the latest published (a publication in flight), else the latest published; None before any."""
        if self.latest is None and self.trainer_version < 0:
            return None
        return max(self.latest if self.latest is not None else -1, self.trainer_version)

    def behind(self, engine_version: int) -> bool:
        ref = self.reference()
        return ref is not None and ref - engine_version > self.max_policy_lag

    def ahead(self) -> bool:
        quota = self.quota()
        return quota is not None and self.taken >= quota

    def open(self, engine_version: int) -> bool:
        return not self.behind(engine_version) and not self.ahead()

    def grant(self) -> None:
        """Liveness guard: allow one more trainer step's worth of prompts (see the module docstring)."""
        self.granted += max(1, math.ceil(self.groups_per_step))

    def reason(self, engine_version: int) -> str:
        if self.behind(engine_version):
            return (f"weights at version {engine_version}, the trainer's {self.reference()} "
                    f"(lag > {self.max_policy_lag})")
        if self.ahead():
            return (f"{self.taken} prompts taken, quota {self.quota()} at trainer step {self.latest_step} "
                    f"({self.trained():.2f} batches trained since this generator started) "
                    f"(ahead of the trainer)")
        return ""
