"""Configuration of weight synchronisation between the trainer and the generators."""

from __future__ import annotations

from dataclasses import dataclass

from topics.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How new weights reach the generators."""

    transport: str = "auto"  # "auto" (nccl on GPU, gloo on CPU) | "nccl" | "gloo" | "file"
    host: str = "127.0.0.1"  # trainer-side rendezvous host for collective transports
    port: int = 0  # 0 = a free port
    shared_dir: str = ""  # for the file transport (empty = <run_dir>/weights)
    bucket_mb: int = 64
    timeout_s: float = 30.0  # every collective and request is bounded by this
    ack_deadline_s: float = 30.0  # a generator that has not acked by then is fenced
    pause_mode: str = "keep"  # vLLM pause_generation mode around a swap: "keep" | "wait"

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "nccl", "gloo", "file"):
            raise ConfigError("weightsync.transport", "must be auto, nccl, gloo or file")
        if self.pause_mode not in ("keep", "wait"):
            raise ConfigError("weightsync.pause_mode", "must be 'keep' or 'wait'")
        if self.timeout_s <= 0:
            raise ConfigError("weightsync.timeout_s", "must be positive")
        if self.bucket_mb < 1:
            raise ConfigError("weightsync.bucket_mb", "must be at least 1")
