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
