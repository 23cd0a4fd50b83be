"""CPU lists for role placement (``runtime/cpus.py``) and the config keys that take them."""

from __future__ import annotations

import os
import threading

import pytest

from runtime.cpus import available, parse_cpus, pin
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
    with pytest.raises(ConfigError, match="generator.loop_cpus"):
        load_config(None, [f"--generator.loop_cpus={bad}"], environ={})


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


def test_pin_moves_the_threads_the_process_already_has() -> None:
    """A generator pins itself before its engine starts and moves its own process (``generator.loop_cpus``) after:
    the threads started in between (vLLM's, the tracer's) move with it."""
    before = os.sched_getaffinity(0)
    release = threading.Event()
    started = threading.Event()
    ids: list[int] = []

    def wait() -> None:
        ids.append(threading.get_native_id())
        started.set()
        release.wait(30)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    started.wait(5)
    try:
        first = min(before)
        pin(str(first))
        assert os.sched_getaffinity(ids[0]) == {first}
        spec = ",".join(map(str, sorted(before)))
        assert pin(spec, key="generator.loop_cpus", allowed=before) == sorted(before)
        assert os.sched_getaffinity(ids[0]) == before == os.sched_getaffinity(0)
    finally:
        release.set()
        thread.join(5)
        os.sched_setaffinity(0, before)


def test_available_checks_cores_against_the_set_given() -> None:
    assert available("0-3", key="generator.loop_cpus", allowed={0, 1, 2, 3}) == [0, 1, 2, 3]
    assert available("", allowed=set()) == []
    with pytest.raises(ConfigError, match="generator.loop_cpus.*cores \\[3\\]"):
        available("1-3", key="generator.loop_cpus", allowed={0, 1, 2})


def test_omp_spin_sets_the_variable_unless_the_environment_has_one() -> None:
    from runtime.cpus import omp_spin

    env: dict[str, str] = {}
    assert omp_spin(10_000, environ=env) == "10000" and env == {"GOMP_SPINCOUNT": "10000"}
    env = {"GOMP_SPINCOUNT": "0"}
    assert omp_spin(10_000, environ=env) == "0"  # the operator's own setting wins
    env = {}
    assert omp_spin(-1, environ=env) is None and env == {}  # OpenMP's default


def test_run_trainer_sets_the_spin_before_torch_loads(monkeypatch) -> None:
    """``streamforge run trainer`` applies ``trainer.omp_spincount`` before the role's import; other roles leave it."""
    from streamforge.roles import prepare_process

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    config = load_config(None, ["--trainer.omp_spincount=2500"])
    prepare_process("generator", config)
    assert "GOMP_SPINCOUNT" not in os.environ
    prepare_process("trainer", config)
    assert os.environ["GOMP_SPINCOUNT"] == "2500"
    with pytest.raises(ConfigError, match="trainer.omp_spincount"):
        load_config(None, ["--trainer.omp_spincount=-2"])
