"""Configuration of a reward service (``streamforge run reward``): what it serves and how its replicas beat."""

from __future__ import annotations

from dataclasses import dataclass

from topics.errors import ConfigError
from topics.names import valid_replica_id, valid_service_name


@dataclass(kw_only=True, slots=True)
class RewardServiceConfig:
    """A reward too heavy for a generator (an LLM judge, a sandboxed checker), served by replicas. A generator
    calls it with ``remote:<name>`` in ``generator.rewards``: one request per GRPO group."""

    name: str = ""  # the service name; a generator's reward "remote:<name>" calls its replicas
    impl: str = ""  # "module:fn" with fn(prompt, response_text) -> float, called once per response
    replica_id: str = ""  # this replica's id; empty = "<name>-<hostname>-<pid>"
    capacity: int = 8  # requests (batches) one replica serves at once; more are refused and the caller tries another
    workers: int = 4  # threads calling fn in one replica
    timeout_s: float = 30.0  # a response not scored this long after its request arrived gets an error, not a score
    heartbeat_s: float = 1.0  # how often a replica announces itself and its load
    health_timeout_s: float = 3.0  # a replica silent for longer is taken out of routing

    def __post_init__(self) -> None:
        if self.name and not valid_service_name(self.name):
            raise ConfigError("reward.name", f"{self.name!r}: 1 to 64 letters, digits, '_' or '-'")
        if self.impl and not self.name:
            raise ConfigError("reward.name", "a served reward needs a service name (generators call remote:<name>)")
        if self.replica_id and not valid_replica_id(self.replica_id):
            raise ConfigError("reward.replica_id", f"{self.replica_id!r}: letters, digits, '_' or '-' (at most 128)")
        for key in ("capacity", "workers"):
            if getattr(self, key) < 1:
                raise ConfigError(f"reward.{key}", "must be at least 1")
        for key in ("timeout_s", "heartbeat_s", "health_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"reward.{key}", "must be > 0")
        if self.health_timeout_s <= self.heartbeat_s:
            raise ConfigError("reward.health_timeout_s", "must be longer than reward.heartbeat_s")
