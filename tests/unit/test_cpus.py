"""CPU lists for role placement (``runtime/cpus.py``) and the config keys that take them."""

from __future__ import annotations

import os

import pytest

from runtime.cpus import parse_cpus, pin
from streamforge.config import load_config
from topics.errors import ConfigError


def test_cpu_lists_parse_like_vllms_bind_syntax() -> None:
    assert parse_cpus("") == []
    assert parse_cpus("3") == [3]
    assert parse_cpus("0-3") == [0, 1, 2, 3]
    assert parse_cpus("4-5, 1,1") == [1, 4, 5]


@pytest.mark.parametrize("bad", ["a", "3-1", "-1", "0-", "1;2"])
def test_a_bad_cpu_list_names_its_key(bad: str) -> None:
    with pytest.raises(ConfigError, match="trainer.cpus"):
        load_config(None, [f"--trainer.cpus={bad}"], environ={})
    with pytest.raises(ConfigError, match="generator.cpus"):
        load_config(None, [f"--generator.cpus={bad}"], environ={})


def test_pin_restricts_this_process_and_refuses_cores_it_cannot_use() -> None:
    before = os.sched_getaffinity(0)
    try:
        first = min(before)
        assert pin("") == []
        assert os.sched_getaffinity(0) == before
        assert pin(str(first), key="trainer.cpus") == [first]
        assert os.sched_getaffinity(0) == {first}
        with pytest.raises(ConfigError, match="trainer.cpus"):
            pin(str(max(before) + 1000), key="trainer.cpus")
    finally:
        os.sched_setaffinity(0, before)
