"""producers/vllm_fork.py: which engines fork, and where a forked worker's threads go."""

from __future__ import annotations

import pytest

from producers import vllm_fork


@pytest.mark.parametrize("environ,expected", [
    ({"OMP_NUM_THREADS": "1", "OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}, ({0}, 1)),
    ({"OMP_NUM_THREADS": "3", "OMP_PLACES": "{2,3,4}"}, ({2, 3, 4}, 3)),
    ({"OMP_NUM_THREADS": "4", "GOMP_CPU_AFFINITY": "0 1 2-3"}, ({0, 1, 2, 3}, 4)),
    ({"OMP_NUM_THREADS": "2", "KMP_AFFINITY": "granularity=fine,explicit,proclist=[5,7]"}, ({5, 7}, 2)),
    ({"OMP_NUM_THREADS": "2"}, None),  # a thread count alone is not vLLM placing a worker
    ({"OMP_PLACES": "{0}"}, None),
    ({"OMP_NUM_THREADS": "x", "OMP_PLACES": "{0}"}, None),
    ({}, None),
])
def test_placement_reads_what_vllm_sets_around_a_worker(environ, expected):
    assert vllm_fork.placement(environ) == expected


def test_auto_forks_only_an_owned_cpu_process(monkeypatch):
    """``auto``: not in a process no generator owns (it may have run an OpenMP team), never with ``uni`` or
    placement off, nor where the user chose a start method; ``fork`` and ``spawn`` are obeyed."""
    monkeypatch.setattr(vllm_fork, "_owned", False)
    monkeypatch.setattr(vllm_fork, "_USER_METHOD", None)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert not vllm_fork.wants_fork("auto", None)
    monkeypatch.setattr(vllm_fork, "_owned", True)
    assert vllm_fork.wants_fork("auto", None) and vllm_fork.wants_fork("auto", "mp")
    assert not vllm_fork.wants_fork("auto", "uni") and not vllm_fork.wants_fork("fork", "uni")
    assert not vllm_fork.wants_fork("spawn", None)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert not vllm_fork.wants_fork("auto", None)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(vllm_fork, "_USER_METHOD", "spawn")
    assert not vllm_fork.wants_fork("auto", None)
    monkeypatch.setattr(vllm_fork, "_owned", False)
    assert vllm_fork.wants_fork("fork", None)


def test_forking_sets_the_method_and_flag_only_while_open(monkeypatch):
    monkeypatch.setenv(vllm_fork.METHOD_ENV, "spawn")  # what vLLM's CPU platform leaves after building a config
    with vllm_fork.forking():
        import os

        assert os.environ[vllm_fork.METHOD_ENV] == "fork" and os.environ[vllm_fork.FLAG] == "1"
    assert os.environ[vllm_fork.METHOD_ENV] == "spawn" and vllm_fork.FLAG not in os.environ
