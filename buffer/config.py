"""Configuration of the replay-buffer role."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from topics.errors import ConfigError, check_choices


@dataclass(kw_only=True, slots=True)
class BufferConfig:
    """Grouping, advantages, filters, batching, backpressure and recovery of the replay buffer.

    The rules these values drive are written in ``buffer/state.py`` (state machine) and ``buffer/policies.py``
    (advantages, filters, batching).
    """

    buffer_id: str = ""  # stable id of this buffer process; empty = "<hostname>-<pid>"
    group_timeout_s: float = 60.0  # a group still incomplete this long after its first episode is decided
    incomplete_policy: Literal["drop", "complete"] = "drop"  # complete = batch what arrived
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"  # how rewards in a group become advantages
    advantage_eps: float = 1e-4
    reward_scale: float = 1.0
    reward_clip: float = 0.0  # 0 = no clipping
    filter_zero_variance: bool = True
    # the most versions an episode may lag the version that will train it (derived: streamforge/staleness.py)
    max_policy_lag: int = 4
    max_response_tokens: int = 0  # 0 = no overlong filter
    filter_truncated: bool = False  # also drop responses whose finish_reason is "length" (as overlong)
    groups_per_batch: int = 4
    token_budget: int = 0  # >0: batch by token count instead of group count
    budget_count: Literal["padded", "tokens"] = "padded"  # padded = rows x longest row; tokens = sum of lengths
    batching: Literal["pad", "pack"] = "pad"  # pad = one episode per row; pack = several per row (segment ids)
    pack_row_tokens: int = 0  # with "pack": tokens per row; 0 = the batch's longest episode
    pad_token_id: int = 0
    pad_to_multiple: int = 1  # round the batch's padded length up to a multiple of this
    max_batch_wait_s: float = 5.0  # publish a partial batch once its oldest group waited this long
    # >0: publish at most this many batches beyond what the trainer has trained (batches-topic high-water
    # minus the step of the latest PolicyVersion); scored groups wait (and are re-checked for staleness),
    # then consumption pauses at max_pending_episodes. 0 = publish as fast as groups complete (a buffer run
    # alone; a run's config refuses it). Derived from staleness.max_versions (streamforge/staleness.py).
    max_batches_ahead: int = 2
    # stop consuming beyond this many episodes held in memory. Keep it above (groups in flight at once) x
    # group_size: when only incomplete groups are held the buffer waits for their timeout (and drops them).
    max_pending_episodes: int = 4096
    dedup_window: int = 200_000  # decided episode ids remembered for deduplication
    poll_max_records: int = 1000  # records per fetch
    fetch_min_bytes: int = 1  # the episodes consumer's fetch waits for this much (or kafka.fetch_max_wait_ms)
    recovery_skew_s: float = 10.0  # clock skew allowed between hosts when recovering (widens the scan)
    commit_interval_s: float = 0.2  # commit episode offsets at most this often (and on drain)
    # an offset gap (records never received while later ones were, buffer/gaps.py) open this long turns the role's
    # health to failing, naming the partition and offset; the buffer keeps re-reading and never commits past it
    offset_gap_fail_s: float = 10.0
    # compression of the buffer's own records (batches, drops); empty = kafka.compression. Not lz4 by default:
    # aiokafka's lz4 is LZ4HC level 9, measured 7 MB/s on a Batch here (snappy 285 MB/s, zstd 71 MB/s).
    output_compression: Literal["", "none", "gzip", "lz4", "zstd", "snappy"] = "snappy"
    # record-batch size of the buffer's producer: aiokafka sends one batch per partition per request with one
    # request in flight, so at its 16 KiB default every ~100 KB Batch costs a broker round trip of its own
    output_batch_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        check_choices(self, "buffer")
        if self.groups_per_batch < 1:
            raise ConfigError("buffer.groups_per_batch", "must be at least 1")
        if self.max_batches_ahead < 0:
            raise ConfigError("buffer.max_batches_ahead", "must be >= 0")
        if self.max_pending_episodes < 1:
            raise ConfigError("buffer.max_pending_episodes", "must be at least 1")
        if self.group_timeout_s <= 0:
            raise ConfigError("buffer.group_timeout_s", "must be positive")
        if self.max_policy_lag < 0:
            raise ConfigError("buffer.max_policy_lag", "must be >= 0")
        if self.token_budget < 0:
            raise ConfigError("buffer.token_budget", "must be >= 0")
        if self.max_response_tokens < 0:
            raise ConfigError("buffer.max_response_tokens", "must be >= 0")
        if self.pack_row_tokens < 0:
            raise ConfigError("buffer.pack_row_tokens", "must be >= 0")
        if self.pad_to_multiple < 1:
            raise ConfigError("buffer.pad_to_multiple", "must be at least 1")
        if self.max_batch_wait_s <= 0:
            raise ConfigError("buffer.max_batch_wait_s", "must be positive")
        if self.dedup_window < 1:
            raise ConfigError("buffer.dedup_window", "must be at least 1")
        if self.poll_max_records < 1:
            raise ConfigError("buffer.poll_max_records", "must be at least 1")
        if self.output_batch_bytes < 16384:
            raise ConfigError("buffer.output_batch_bytes", "must be at least 16384")
        if self.commit_interval_s < 0:
            raise ConfigError("buffer.commit_interval_s", "must be >= 0")
        if self.offset_gap_fail_s <= 0:
            raise ConfigError("buffer.offset_gap_fail_s", "must be positive")
        if self.reward_scale <= 0:
            raise ConfigError("buffer.reward_scale", "must be > 0")
        if self.reward_clip < 0:
            raise ConfigError("buffer.reward_clip", "must be >= 0 (0 = no clipping)")
