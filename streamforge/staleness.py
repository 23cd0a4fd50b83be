"""One staleness setting, ``staleness.max_versions``, and the bounds of the roles derived from it.

The staleness of a trained token is ``v_train - v_token``: the trainer's policy version when it trains the token
minus the version that sampled it. ``staleness.max_versions`` (``S``) bounds it for every trained token; ``0`` is
synchronous training (every batch from the latest weights). Four knobs of three roles keep the bound, and unless a
config sets them explicitly they are derived from ``S`` (``derived_overrides``):

* ``buffer.max_batches_ahead`` (``A``) = 1 for ``S = 0``, else 2: the buffer publishes at most ``A`` batches
  beyond the step of the latest published version, so a batch waits at most ``A - 1`` trainer steps, and the
  trainer's version moves at most ``A - 1`` versions between the batch's forming and its training;
* ``buffer.max_policy_lag`` (``B``) = ``S - (A - 1)``: when the buffer forms a batch, no episode in it is more
  than ``B`` versions older than the latest (older ones are dropped as ``stale``), hence
  ``v_train - v_token <= B + A - 1 = S``;
* ``generator.max_policy_lag`` = ``B``: a generator whose weights are more than ``B`` versions old takes no new
  prompt (what it would sample is stale on arrival);
* ``generator.groups_per_version`` = ``ceil(buffer.groups_per_batch * trainer.publish_every / up.generators)``
  (0, no quota, when batches are cut by ``buffer.token_budget``): each generator's share of the groups the trainer
  trains per version. With the generator's window of ``max_policy_lag + 1`` versions it never holds more useful
  work in flight than the trainer can train while it is fresh, so it is throttled instead of producing episodes
  the buffer must drop as stale. A group the buffer will drop for zero variance does not count against the quota
  (``generator.quota_counts_zero_variance`` = not ``buffer.filter_zero_variance``).

The trainer enforces the bound where it matters: a batch holding a token more than ``S`` versions behind the
trainer's version when its turn comes is not trained; it is dead-lettered with reason ``stale`` and counted
(``stale_batches`` in ``metrics.jsonl``, ``stale_batches`` in the audit). Explicit settings that cannot keep the
bound (``B + A - 1 > S``, or ``A = 0``: no limit) are refused at load time by ``check_staleness``, naming the keys.

``staleness.max_versions: -1`` turns the bound off: the buffer publishes batches as fast as groups complete
(``max_batches_ahead`` 0) and drops nothing as stale, the generators take prompts whatever their weights' age,
and the trainer trains whatever it receives (a buffer run alone, or offline batching).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from topics.errors import ConfigError

# the keys derived from staleness.max_versions unless a config layer sets them
UNBOUNDED_LAG = 1_000_000  # the lags of staleness.max_versions -1: nothing is ever that stale
DERIVED_KEYS = ("buffer.max_batches_ahead", "buffer.max_policy_lag", "generator.max_policy_lag",
                "generator.groups_per_version", "generator.quota_counts_zero_variance")


@dataclass(kw_only=True, slots=True)
class StalenessConfig:
    """How stale a trained token may be, in policy versions (the module docstring says what derives from it)."""

    # most versions a trained token may lag the trainer's version (0 = synchronous, -1 = no bound)
    max_versions: int = 2

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
        return 1 if self.max_versions == 0 else 2

    @property
    def buffer_lag(self) -> int:
        """``B``: the buffer's (and the generators') ``max_policy_lag``."""
        if not self.bounded:
            return UNBOUNDED_LAG
        return self.max_versions - (self.batches_ahead - 1)


def derived_values(config: Any) -> dict[str, Any]:
    """Every derived key's value for ``config`` (a ``RunConfig``), from the module docstring's rules."""
    s: StalenessConfig = config.staleness
    generators = max(1, config.up.generators)
    per_version = 0
    if config.buffer.token_budget == 0 and s.bounded:
        per_version = math.ceil(config.buffer.groups_per_batch * config.trainer.publish_every / generators)
    return {
        "buffer.max_batches_ahead": s.batches_ahead,
        "buffer.max_policy_lag": s.buffer_lag,
        "generator.max_policy_lag": s.buffer_lag,
        "generator.groups_per_version": per_version,
        "generator.quota_counts_zero_variance": not config.buffer.filter_zero_variance,
    }


def derived_overrides(config: Any, explicit: set[str]) -> list[str]:
    """Dotlist entries (``key=value``) for the derived keys that no config layer set (``explicit``)."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in derived_values(config).items()
            if k not in explicit]


def check_staleness(config: Any) -> None:
    """Refuse settings that break the bound, naming both keys. Skipped in SFT mode (no policy versions)."""
    if config.trainer.mode != "rl":
        return
    s = config.staleness.max_versions
    gen, buf = config.generator, config.buffer
    if gen.max_policy_lag > buf.max_policy_lag:
        raise ConfigError("generator.max_policy_lag", f"{gen.max_policy_lag} exceeds buffer.max_policy_lag "
                          f"{buf.max_policy_lag}: the generators would produce episodes the buffer must drop")
    if not config.staleness.bounded:
        return
    if buf.max_batches_ahead == 0:
        raise ConfigError("buffer.max_batches_ahead", f"0 (no limit) cannot keep staleness.max_versions {s}: "
                          "batches formed long before the trainer reaches them go stale in the topic")
    bound = buf.max_policy_lag + buf.max_batches_ahead - 1
    if bound > s:
        raise ConfigError("buffer.max_policy_lag", f"buffer.max_policy_lag {buf.max_policy_lag} + "
                          f"buffer.max_batches_ahead {buf.max_batches_ahead} - 1 = {bound} exceeds "
                          f"staleness.max_versions {s}: raise staleness.max_versions or lower them")
