"""producers/vllm_poll.py: the poll asked of vLLM's processes travels in the environment they inherit."""

from __future__ import annotations

import pytest

from producers import vllm_poll
from producers.config import GeneratorConfig
from topics.errors import ConfigError


def test_set_poll_s_round_trips_and_none_leaves_vllm_its_own(monkeypatch):
    monkeypatch.delenv(vllm_poll.ENV, raising=False)
    assert vllm_poll.poll_s() is None
    vllm_poll.set_poll_s(0.02)
    assert vllm_poll.poll_s() == 0.02
    vllm_poll.set_poll_s(None)
    assert vllm_poll.poll_s() is None


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_a_bad_or_negative_value_keeps_vllms_poll(monkeypatch, raw):
    monkeypatch.setenv(vllm_poll.ENV, raw)
    assert vllm_poll.poll_s() is None


def test_generator_config_takes_minus_one_for_vllms_own_and_refuses_other_negatives():
    assert GeneratorConfig().vllm_poll_s == vllm_poll.DEFAULT_POLL_S
    assert GeneratorConfig(vllm_poll_s=-1).vllm_poll_s == -1
    with pytest.raises(ConfigError, match="generator.vllm_poll_s"):
        GeneratorConfig(vllm_poll_s=-0.5)


def test_the_plugins_are_registered_with_vllm():
    """The poll, and the one-call swap of producers/vllm_swap.py (tested against vLLM in test_generator.py)."""
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("streamforge_poll") == "producers.vllm_poll:register"
    assert names.get("streamforge_swap") == "producers.vllm_swap:register"


def test_the_swap_plugin_patches_only_a_process_that_runs_an_engine_core(monkeypatch):
    import sys

    from producers import vllm_swap

    monkeypatch.delitem(sys.modules, "vllm.v1.engine.core", raising=False)
    vllm_swap.register()  # a worker process (vLLM loads general plugins there too): nothing to patch, no import
    assert "vllm.v1.engine.core" not in sys.modules


def test_the_variable_is_not_read_as_a_config_key():
    """A role started by a process whose engine set the variable inherits it; it must not fail as a config key."""
    from streamforge.config import env_overrides

    assert env_overrides({vllm_poll.ENV: "0.02"}) == []


def test_the_executor_is_vllms_choice_unless_named():
    """``generator.vllm_executor``: ``auto`` leaves vLLM's choice (None), pinned or not; ``mp`` and ``uni`` are
    passed on as they are."""
    assert GeneratorConfig(cpus="1").engine_executor() is None
    assert GeneratorConfig(cpus="").engine_executor() is None
    assert GeneratorConfig(cpus="1", vllm_executor="mp").engine_executor() == "mp"
    assert GeneratorConfig(cpus="1", vllm_executor="uni").engine_executor() == "uni"
    with pytest.raises(ConfigError, match="generator.vllm_executor"):
        GeneratorConfig(vllm_executor="ray")
