"""An OpenEnv environment for the tests, served by real replicas (``--env.impl helpers.countenv:CountEnv``).

``CountEnv`` counts turns: ``reset`` answers ``episode <id> starts``; a step echoes the action with its turn
(``turn <n>: <first 40 characters>``), reward 1.0 per turn, done after ``options["turns"]`` turns (default 3).
Some actions misbehave on purpose: ``boom`` raises, ``sleep:<seconds>`` sleeps, ``illegal`` raises
``ActionRejected`` from ``step``, an action starting ``reject`` fails the Action model's validator.
"""

from __future__ import annotations

import time
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import field_validator

from envs.api import ActionRejected


class CountAction(Action):
    text: str

    @field_validator("text")
    @classmethod
    def refuse(cls, value: str) -> str:
        if value.startswith("reject"):
            raise ValueError("the validator refuses this action")
        return value


class CountObservation(Observation):
    text: str = ""
    turn: int = 0


class CountEnv(Environment[CountAction, CountObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.turns = 0
        self.limit = 3
        self.episode_id: str | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CountObservation:
        self.turns, self.episode_id = 0, episode_id
        self.limit = int(kwargs.get("turns", 3))
        return CountObservation(text=f"episode {episode_id} starts", turn=0)

    def step(self, action: CountAction, timeout_s: float | None = None, **kwargs: Any) -> CountObservation:
        text = action.text
        if text == "boom":
            raise RuntimeError("the environment broke")
        if text.startswith("sleep:"):
            time.sleep(float(text.split(":", 1)[1]))
        if text == "illegal":
            raise ActionRejected("illegal move")
        self.turns += 1
        return CountObservation(text=f"turn {self.turns}: {text[:40]}", turn=self.turns, reward=1.0,
                                done=self.turns >= self.limit)

    @property
    def state(self) -> State:
        return State(episode_id=self.episode_id, step_count=self.turns)
