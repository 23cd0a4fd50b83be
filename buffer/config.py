"""Configuration of the replay-buffer role."""

from __future__ import annotations

from dataclasses import dataclass

from topics.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class BufferConfig:
    """Grouping, advantages, filters and batching of the replay buffer."""

    group_timeout_s: float = 60.0
    incomplete_policy: str = "drop"  # "drop" | "complete" (batch what arrived)
    advantage: str = "grpo"  # "grpo" | "dr_grpo" | "rloo"
    advantage_eps: float = 1e-4
    reward_scale: float = 1.0
    reward_clip: float = 0.0  # 0 = no clipping
    filter_zero_variance: bool = True
    max_policy_lag: int = 2  # drop episodes older than latest - max_policy_lag
    max_response_tokens: int = 0  # 0 = no overlong filter
    groups_per_batch: int = 4
    token_budget: int = 0  # >0: batch by token count instead of group count
    max_pending_episodes: int = 4096  # stop consuming beyond this many episodes held in memory

    def __post_init__(self) -> None:
        if self.incomplete_policy not in ("drop", "complete"):
            raise ConfigError("buffer.incomplete_policy", "must be 'drop' or 'complete'")
        if self.advantage not in ("grpo", "dr_grpo", "rloo"):
            raise ConfigError("buffer.advantage", "must be 'grpo', 'dr_grpo' or 'rloo'")
        if self.groups_per_batch < 1:
            raise ConfigError("buffer.groups_per_batch", "must be at least 1")
        if self.max_pending_episodes < 1:
            raise ConfigError("buffer.max_pending_episodes", "must be at least 1")
        if self.group_timeout_s <= 0:
            raise ConfigError("buffer.group_timeout_s", "must be positive")
        if self.max_policy_lag < 0:
            raise ConfigError("buffer.max_policy_lag", "must be >= 0")
