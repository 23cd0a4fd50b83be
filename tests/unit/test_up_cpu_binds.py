"""``streamforge up`` spreads several CPU generators over the cores instead of letting vLLM pin them all to core 0."""

from __future__ import annotations

from streamforge.up import cpu_binds


def test_one_generator_keeps_vllms_own_binding() -> None:
    assert cpu_binds(1, cpus=8, environ={}) == [None]


def test_generators_get_disjoint_core_ranges() -> None:
    assert cpu_binds(2, cpus=8, environ={}) == ["0-3", "4-7"]
    assert cpu_binds(3, cpus=8, environ={}) == ["0-1", "2-3", "4-5"]  # the spare cores stay for the other roles
    assert cpu_binds(2, cpus=2, environ={}) == ["0", "1"]


def test_more_generators_than_cores_share_round_robin() -> None:
    assert cpu_binds(3, cpus=2, environ={}) == ["0", "1", "0"]


def test_a_users_binding_wins() -> None:
    assert cpu_binds(2, cpus=8, environ={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == [None, None]
    assert cpu_binds(0, cpus=8, environ={}) == []


def test_a_failed_roles_log_tail_keeps_the_line_that_says_why(tmp_path) -> None:
    from streamforge.up import Child

    log = tmp_path / "trainer.log"
    log.write_text("start\nstreamforge: role 'trainer': loop 'train' stopped unexpectedly (boom)\n"
                   + "".join(f"nanobind: leaked {i}\n" for i in range(40)))
    tail = Child("trainer", "trainer", [], log).log_tail(5).splitlines()
    assert tail[0].endswith("(boom)") and tail[-1] == "nanobind: leaked 39" and len(tail) == 7
    log.write_text("a\nb\n")
    assert Child("trainer", "trainer", [], log).log_tail(5) == "a\nb"


def _config(*overrides: str):
    from streamforge.config import load_config

    return load_config(None, list(overrides), environ={})


def test_cpu_plan_keeps_vllms_placement_on_small_hosts() -> None:
    """Below 4 cores (2 measured: the split was no faster) the trainer keeps every core and vLLM its own choice."""
    from streamforge.up import cpu_plan

    assert cpu_plan(_config(), cpus=2, environ={}, cuda=False) == (None, [None])
    assert cpu_plan(_config(), cpus=3, environ={}, cuda=False) == (None, [None])
    assert cpu_plan(_config("--up.generators=2"), cpus=2, environ={}, cuda=False) == (None, ["0", "1"])


def test_cpu_plan_gives_the_trainer_and_the_engines_disjoint_cores() -> None:
    from streamforge.up import cpu_plan

    assert cpu_plan(_config(), cpus=8, environ={}, cuda=False) == ("4-7", ["0-3"])
    assert cpu_plan(_config(), cpus=5, environ={}, cuda=False) == ("3-4", ["0-2"])  # round(2.5) = 2 for the trainer
    assert cpu_plan(_config("--up.generators=2", "--up.evaluators=1"), cpus=8, environ={}, cuda=False) == (
        "4-7", ["0", "1", "2"])
    assert cpu_plan(_config("--up.trainer_cpu_share=0.25"), cpus=16, environ={}, cuda=False) == ("12-15", ["0-11"])
    assert cpu_plan(_config(), cpus=[2, 3, 5, 7], environ={}, cuda=False) == ("5,7", ["2-3"])  # this process's set
    assert cpu_plan(_config("--up.trainer_cpu_share=0.99"), cpus=4, environ={}, cuda=False) == ("1-3", ["0"])


def test_cpu_plan_leaves_placement_to_whoever_set_it() -> None:
    from streamforge.up import cpu_plan

    for overrides in (["--trainer.cpus=1"], ["--generator.cpus=0"], ["--up.cpu_partition=false"],
                      ["--trainer.world_size=2"]):
        assert cpu_plan(_config(*overrides), cpus=8, environ={}, cuda=False) == (None, [None]), overrides
    assert cpu_plan(_config(), cpus=8, environ={"VLLM_CPU_OMP_THREADS_BIND": "0-5"}, cuda=False) == (None, [None])
    assert cpu_plan(_config(), cpus=8, environ={}, cuda=True) == (None, [None])  # GPU builds ignore the bind
    assert cpu_plan(_config("--up.generators=0"), cpus=8, environ={}, cuda=False) == (None, [])


def test_cpu_plan_settings_are_checked_at_start_up() -> None:
    import pytest

    from streamforge.config import ConfigError
    from streamforge.up import cuda_host

    for share in ("0", "1", "1.5"):
        with pytest.raises(ConfigError, match="up.trainer_cpu_share"):
            _config(f"--up.trainer_cpu_share={share}")
    assert cuda_host({"CUDA_VISIBLE_DEVICES": ""}) is False
