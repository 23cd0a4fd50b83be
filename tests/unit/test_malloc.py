"""runtime/malloc.py: the allocator environment of `up`'s roles, and glibc or jemalloc keeping freed memory (a
large block freed and allocated again is not faulted in again)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from runtime.malloc import JEMALLOC_CONF, allocator_env, find_jemalloc
from topics.errors import ConfigError

CODE = textwrap.dedent("""
    import resource, sys, torch
    from runtime.malloc import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    def rounds():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            x = torch.empty(25 * 1024 * 1024)  # 100 MB, above glibc's largest mmap threshold
            x.fill_(1.0)
            del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    rounds()
    print("jemalloc" in open("/proc/self/maps").read(), rounds())
""")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, /proc")


def _faults(mode: str, extra_env: dict[str, str]) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}  # glibc unless asked
    env.update(PYTHONPATH=os.getcwd(), **extra_env)
    out = subprocess.run([sys.executable, "-c", CODE, mode], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    return out[-2] == "True", int(out[-1])


@linux
def test_keep_freed_memory_stops_a_freed_block_from_faulting_in_again() -> None:
    """A 100 MB tensor allocated and freed ten times (in a subprocess, so this one's allocator is left alone):
    by default every round maps fresh pages (25,600 faults each), with the setting the heap hands the same back."""
    assert _faults("default", {})[1] > 10 * 20_000
    assert _faults("keep", {})[1] < 2_000


@linux
@pytest.mark.skipif(find_jemalloc() is None, reason="no libjemalloc.so.2 on this host (Debian: libjemalloc2)")
def test_jemalloc_from_allocator_env_is_loaded_and_keeps_freed_memory() -> None:
    loaded, faults = _faults("default", allocator_env("jemalloc", environ={}))
    assert loaded
    assert faults < 2_000


def test_allocator_env_choices() -> None:
    assert allocator_env("glibc", jemalloc="/x/libjemalloc.so.2") == {}
    assert allocator_env("auto", jemalloc=None) == {}
    with pytest.raises(ConfigError, match="up.allocator"):
        allocator_env("jemalloc", jemalloc=None)
    env = allocator_env("auto", environ={"LD_PRELOAD": "/y/libother.so"}, jemalloc="/x/libjemalloc.so.2")
    assert env == {"LD_PRELOAD": "/x/libjemalloc.so.2 /y/libother.so", "MALLOC_CONF": JEMALLOC_CONF}
    assert allocator_env("jemalloc", environ={"MALLOC_CONF": "narenas:2"},
                         jemalloc="/x/libjemalloc.so.2")["MALLOC_CONF"] == "narenas:2"  # the user's own wins
