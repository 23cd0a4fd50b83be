"""One staleness setting, ``staleness.max_versions``, and the bounds of the roles derived from it.

The staleness of a trained token is ``v_train - v_token``: the trainer's policy version when it trains the token
minus the version that sampled it. ``staleness.max_versions`` (``S``) bounds it for every trained token; ``0`` is
synchronous training (every batch from the latest weights). The knobs below keep the bound, and unless a config
sets them explicitly they are derived from ``S`` (``derived_values``); ``P`` is ``trainer.publish_every`` and
``N`` is ``up.generators``:

* ``buffer.max_batches_ahead`` (``A``) = 1 for ``S = 0``, else ``S - G`` within [1, 2] (``G`` below): the buffer
  publishes at most ``A`` batches beyond the trainer step of the latest published version. A batch cut behind
  ``A`` queued ones is trained ``A`` versions later, and its episodes come from weights up to ``G`` versions old,
  so ``A + G <= S`` keeps what the generators produce trainable (at ``S = 2`` with two batches queued, every
  episode a generator made one version behind would be dropped as stale: two in five of a tiny-task run's were);
* ``buffer.max_policy_lag`` (``B``) = ``S``: just before the buffer cuts a batch, every episode in it must be at
  most ``B - f`` versions older than the trainer's current version, where ``f`` is how many versions the trainer
  will publish before it reaches that batch (the batches queued before it and the steps not yet published, at the
  rate of versions per step its progress shows, at most one per ``trainer.publish_every`` steps); older ones are
  dropped as ``stale``. So ``v_train - v_token <= (B - f) + f = B <= S`` as far as the estimate holds, and the
  trainer checks the rest (below);
* ``generator.max_policy_lag`` (``G``) = 1 for ``S >= 2``, else 0: a generator takes a new prompt only with weights
  at most ``G`` versions older than the trainer's (the version the trainer trains with, from its progress: a
  publication in flight counts);
* the generators' quota (``producers/flow.py``): ``generator.groups_per_step`` = ``buffer.groups_per_batch / N``
  (0, no quota, when batches are cut by ``buffer.token_budget``), counted in the groups the trainer trained over
  ``generator.quota_groups_per_batch`` = ``buffer.groups_per_batch`` (a batch cut short opens the quota by the
  groups it held), and ``generator.quota_window_steps`` (``W``) =
  ``(S - G) * P + 1``: a generator holds at most ``W`` trainer steps of groups beyond the trainer's step, so, taken
  in order, a group is trained at most ``S - G`` versions after it was taken, by weights at most ``G`` older, and
  the generator is throttled instead of producing what the buffer would drop. ``W`` counts every group taken and
  not yet trained, generating or done, so it must cover the generation time too: when responses take longer than a
  trainer step (long-tailed lengths), most of the groups beyond the ``A`` queued batches and the one being filled
  are still generating, and a window of ``A + 1`` starved the trainer (``bench/scale.py`` at 64 generators: busy
  0.80 with ``W = 3``, 0.97 with ``W = 4`` at ``S = 4``). The cost is where generation is fast: then those groups
  wait in the buffer, trained up to ``W - A - 1`` steps later than with the narrower window (still within ``S``),
  and a few at the bound's edge are dropped as stale when the trainer's pace changes (3% at 64 simulated
  generators); set ``generator.quota_window_steps`` lower to trade throughput for freshness. A group the buffer
  drops for zero variance uses no quota (``generator.quota_counts_zero_variance`` = not
  ``buffer.filter_zero_variance``), nor one it drops for another reason (``producers/refunds.py``).

Batches hold the groups of one ``episodes`` partition (their ids and contents replay deterministically): with few
groups a step, each partition fills slowly and its groups wait, so a run with one buffer keeps
``topics.episodes_partitions`` at 1 (the demo measured 11% of its episodes dropped as stale with 4 partitions at
``S = 4``, none with 1).

The trainer enforces the bound where it matters: a batch holding a token more than ``S`` versions behind the
trainer's version when its turn comes is not trained; it is dead-lettered with reason ``stale`` and counted
(``stale_batches`` in ``metrics.jsonl`` and in the audit). Explicit settings that cannot keep the bound are refused
at load time by ``check_staleness``, naming the keys.

``staleness.max_versions: -1`` turns the bound off: the buffer publishes batches as fast as groups complete
(``max_batches_ahead`` 0) and drops nothing as stale, the generators take prompts whatever their weights' age and
without a quota, and the trainer trains whatever it receives (a buffer run alone, or offline batching).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from topics.errors import ConfigError

UNBOUNDED_LAG = 1_000_000  # the lags of staleness.max_versions -1: nothing is ever that stale
# the keys derived from staleness.max_versions unless a config layer sets them
DERIVED_KEYS = ("buffer.max_batches_ahead", "buffer.max_policy_lag", "generator.max_policy_lag",
                "generator.groups_per_step", "generator.quota_groups_per_batch", "generator.quota_window_steps",
                "generator.quota_counts_zero_variance")


@dataclass(kw_only=True, slots=True)
class StalenessConfig:
    """How stale a trained token may be, in policy versions (the module docstring says what derives from it)."""

    # most versions a trained token may lag the trainer's version (0 = synchronous, -1 = no bound)
    max_versions: int = 4

    def __post_init__(self) -> None:
        if self.max_versions < -1:
            raise ConfigError("staleness.max_versions", "must be >= 0 (0 = synchronous), or -1 for no bound")

    @property
    def bounded(self) -> bool:
        return self.max_versions >= 0

    @property
    def batches_ahead(self) -> int:
        """``A``: batches the buffer may publish beyond the trainer's latest published step (0 = no limit)."""
        if not self.bounded:
            return 0
        return 1 if self.max_versions == 0 else min(2, max(1, self.max_versions - self.generator_lag))

    @property
    def buffer_lag(self) -> int:
        """``B``: the buffer's ``max_policy_lag``."""
        return self.max_versions if self.bounded else UNBOUNDED_LAG

    @property
    def generator_lag(self) -> int:
        """``G``: the generators' ``max_policy_lag``."""
        if not self.bounded:
            return UNBOUNDED_LAG
        return 1 if self.max_versions >= 2 else 0


def derived_values(config: Any) -> dict[str, Any]:
    """Every derived key's value for ``config`` (a ``RunConfig``, or its sections), by the module docstring's rules."""
    s: StalenessConfig = config.staleness
    per_step = 0.0
    if config.buffer.token_budget == 0 and s.bounded:
        per_step = config.buffer.groups_per_batch / max(1, config.up.generators)
    # the widest window the bound allows: groups beyond the buffer's A + 1 batches are mostly still generating
    window = (s.max_versions - s.generator_lag) * config.trainer.publish_every + 1 if s.bounded else 1
    return {
        "buffer.max_batches_ahead": s.batches_ahead,
        "buffer.max_policy_lag": s.buffer_lag,
        "generator.max_policy_lag": s.generator_lag,
        "generator.groups_per_step": round(per_step, 6),
        "generator.quota_groups_per_batch": config.buffer.groups_per_batch if per_step > 0 else 0,
        "generator.quota_window_steps": window,
        "generator.quota_counts_zero_variance": not config.buffer.filter_zero_variance,
    }


def derived_overrides(config: Any, explicit: set[str]) -> list[str]:
    """Dotlist entries (``key=value``) for the derived keys that no config layer set (``explicit``)."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in derived_values(config).items()
            if k not in explicit]


def check_staleness(config: Any) -> None:
    """Refuse settings that break the bound, naming the keys. Skipped in SFT mode (no policy versions) and with
    no bound."""
    if config.trainer.mode != "rl" or not config.staleness.bounded:
        return
    s = config.staleness.max_versions
    gen, buf = config.generator, config.buffer
    if gen.max_policy_lag > buf.max_policy_lag:
        raise ConfigError("generator.max_policy_lag", f"{gen.max_policy_lag} exceeds buffer.max_policy_lag "
                          f"{buf.max_policy_lag}: the generators would produce episodes the buffer must drop")
    if buf.max_batches_ahead == 0:
        raise ConfigError("buffer.max_batches_ahead", f"0 (no limit) cannot keep staleness.max_versions {s}: "
                          "batches formed long before the trainer reaches them go stale in the topic")
    if buf.max_policy_lag > s:
        raise ConfigError("buffer.max_policy_lag", f"{buf.max_policy_lag} exceeds staleness.max_versions {s}: "
                          "raise staleness.max_versions or lower it")
    if buf.max_batches_ahead - 1 > s:
        raise ConfigError("buffer.max_batches_ahead", f"{buf.max_batches_ahead} batches queued make the last "
                          f"{buf.max_batches_ahead - 1} versions stale: more than staleness.max_versions {s}")
