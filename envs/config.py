"""Configuration of an environment: how its replicas serve (``streamforge run env``) and how episodes use it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from topics.errors import ConfigError
from topics.names import valid_replica_id, valid_service_name

# environments that ship with streamforge, by short name (``env.impl``); anything else is "module:Class"
BUILTIN_ENVS: dict[str, str] = {
    "blackjack": "envs.builtin_blackjack:BlackjackEnv",
    "calculator": "envs.builtin_calculator:CalculatorEnv",
}


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    """One environment of a run. Empty ``name``: episodes are single-turn (no environment)."""

    name: str = ""  # the environment's service name: generators route its episodes to replicas registered under it
    impl: str = ""  # an OpenEnv ``Environment`` subclass, "module:Class" or a built-in name (BUILTIN_ENVS)
    replica_id: str = ""  # this replica's id (``run env``); empty = "<name>-<hostname>-<pid>"
    host: str = "127.0.0.1"  # where a replica serves
    port: int = 0  # 0 = a free port
    capacity: int = 64  # sessions one replica holds at once (routing counts its load against this)
    heartbeat_s: float = 1.0  # how often a replica announces itself and its load
    health_timeout_s: float = 3.0  # a replica silent for longer is taken out of routing
    max_turns: int = 8  # model turns per episode at most (then the episode is truncated)
    max_turn_tokens: int = 0  # most new tokens of one model turn (0 = what is left of generator.max_tokens)
    max_restarts: int = 2  # an episode whose replica is lost restarts from reset() on another at most this often
    step_timeout_s: float = 10.0  # a reset or step slower than this is an ``EnvTimeout``
    penalty: float = -1.0  # added to the reward of an episode that ends on an action the environment rejected
    max_action_chars: int = 65536  # a longer model action is rejected before it is sent (``ActionRejected``)
    session_log: bool = False  # a replica logs every reset and step of every session (session, episode) at INFO

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError("env.port", "must be a port number (0 = free port)")
        for key in ("capacity", "max_turns", "max_action_chars"):
            if getattr(self, key) < 1:
                raise ConfigError(f"env.{key}", "must be at least 1")
        if self.max_turn_tokens < 0:
            raise ConfigError("env.max_turn_tokens", "must be >= 0 (0 = no limit per turn)")
        if self.max_restarts < 0:
            raise ConfigError("env.max_restarts", "must be >= 0")
        if not math.isfinite(self.penalty):
            raise ConfigError("env.penalty", "must be a finite number")
        for key in ("heartbeat_s", "health_timeout_s", "step_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"env.{key}", "must be > 0")
        if self.health_timeout_s <= self.heartbeat_s:
            raise ConfigError("env.health_timeout_s", "must be longer than env.heartbeat_s")
        if self.name and not valid_service_name(self.name):
            raise ConfigError("env.name", f"{self.name!r}: 1 to 64 letters, digits, '_' or '-'")
        if self.replica_id and not valid_replica_id(self.replica_id):
            raise ConfigError("env.replica_id", f"{self.replica_id!r}: letters, digits, '_' or '-' (at most 128)")
