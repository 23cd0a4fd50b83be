"""The replica's serving helpers (``envs/serving.py``) without a server, and the service settings' validation."""

from __future__ import annotations

from typing import Any

import pytest
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from envs.api import ActionRejected
from envs.config import EnvConfig
from envs.serving import REJECTED_PREFIX, Rejected, _peek, env_types, resolve_env, serving_classes, text_field
from helpers.countenv import CountAction, CountEnv, CountObservation
from services.config import RewardServiceConfig
from streamforge.config import load_config
from topics.errors import ConfigError


class Move(Action):
    move: str
    count: int = 0


class Board(Observation):
    board: str = ""


class Annotated(Environment):
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> Board:
        return Board()

    def step(self, action: Move, timeout_s: float | None = None, **kw: Any) -> Board:
        if action.move == "bad":
            raise ActionRejected("no such move")
        return Board(board=action.move)

    @property
    def state(self) -> State:
        return State()


class Untyped(Annotated):
    def step(self, action, timeout_s=None, **kw):
        return Board()


def test_the_environment_and_its_models_are_found_by_name_and_by_annotation() -> None:
    assert resolve_env("helpers.countenv:CountEnv") is CountEnv
    assert env_types(CountEnv) == (CountAction, CountObservation)  # Environment[Action, Observation, State]
    assert env_types(Annotated) == (Move, Board)  # step(self, action: Move) -> Board
    for impl in ("", "helpers.nosuch:Env", "helpers.countenv", "helpers.rewards:flaky_judge"):
        with pytest.raises(ConfigError) as err:
            resolve_env(impl)
        assert err.value.key == "env.impl"
    with pytest.raises(ConfigError, match="cannot tell the Action and Observation"):
        env_types(Untyped)


def test_the_text_fields_are_text_or_the_only_string_field() -> None:
    assert text_field(CountAction, required=True) == "text"
    assert text_field(Move, required=True) == "move"
    assert text_field(Board, skip=("done", "reward", "metadata"), required=False) == "board"

    class Two(Action):
        a: str
        b: str

    assert text_field(Two, required=False) == ""
    with pytest.raises(ConfigError, match="needs a field `text: str`"):
        text_field(Two, required=True)


def test_rejections_become_the_marked_execution_error_and_other_errors_stay_what_they_are() -> None:
    env_cls, action_cls = serving_classes(Annotated, Move)
    assert issubclass(env_cls, Annotated) and env_cls.SUPPORTS_CONCURRENT_SESSIONS is False
    assert isinstance(action_cls.model_validate({"move": "e4"}), Move)
    with pytest.raises(Rejected) as err:
        action_cls.model_validate({"move": 3})
    assert str(err.value).startswith(REJECTED_PREFIX + "move: ")
    with pytest.raises(Rejected, match="count"):
        action_cls.model_validate({"move": "e4", "count": "many"})
    env = env_cls()
    assert env.step(Move(move="e4")).board == "e4"
    with pytest.raises(Rejected, match=f"^{REJECTED_PREFIX}no such move$"):
        env.step(Move(move="bad"))
    count_env, count_action = serving_classes(CountEnv, CountAction)
    assert count_env.SUPPORTS_CONCURRENT_SESSIONS is True
    with pytest.raises(Rejected, match="validator refuses"):  # a validator's ValueError: OpenEnv would drop the session
        count_action.model_validate({"text": "reject me"})
    with pytest.raises(RuntimeError, match="broke"):  # an environment's own failure stays an execution error
        count_env().step(CountAction(text="boom"))


@pytest.mark.parametrize(("raw", "seen"), [
    ('{"type":"reset","data":{"episode_id":"e1"}}', ("reset", "e1")),
    ('{"type":"step","data":{"text":"x"}}', ("step", "")),
    ('{"type":"reset","data":{"episode_id":5}}', ("reset", "")),
    ("not json", ("invalid", "")),
    ("[1, 2]", ("invalid", "")),
    ('{"type":' + '"x' * 20 + '"}', ("invalid", "")),
    ("x" * 70_000, ("oversized", "")),
    (b'{"type":"close"}', ("close", "")),
])
def test_the_session_log_reads_messages_without_trusting_them(raw: str | bytes, seen: tuple[str, str]) -> None:
    assert _peek(raw) == seen


@pytest.mark.parametrize(("overrides", "key"), [
    (["--env.name=count"], "env.impl"),  # up would start a replica of an environment it cannot name
    (["--env.impl=helpers.countenv:CountEnv"], "env.name"),
    (["--env.name=count", "--env.impl=x:Y", "--up.envs=2", "--env.port=9000"], "env.port"),
    (["--env.name=a.b", "--up.envs=0"], "env.name"),
    (["--env.replica_id=a:b"], "env.replica_id"),
    (["--env.max_action_chars=0"], "env.max_action_chars"),
    (["--up.envs=-1"], "up.envs"),
    (["--reward.impl=m:f"], "reward.name"),
    (["--reward.name=judge", "--reward.workers=0"], "reward.workers"),
])
def test_service_settings_that_cannot_work_fail_at_load_naming_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, environ={})
    assert err.value.key == key


def test_valid_service_settings_load() -> None:
    cfg = load_config(None, ["--env.name=count", "--up.envs=0", "--reward.name=judge", "--reward.impl=m:f"],
                      environ={})  # replicas that run elsewhere need no impl here
    assert cfg.env == EnvConfig(name="count") and cfg.reward == RewardServiceConfig(name="judge", impl="m:f")
