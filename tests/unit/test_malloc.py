"""runtime/malloc.py: with keep_freed_memory a large block freed in the main thread is reused, not faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

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
    print(rounds())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_stops_a_freed_block_from_faulting_in_again() -> None:
    """A 100 MB tensor allocated and freed ten times (in a subprocess, so this one's allocator is left alone):
    by default every round maps fresh pages (25,600 faults each), with the setting the heap hands the same back."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    faults = {mode: int(subprocess.run([sys.executable, "-c", CODE, mode], capture_output=True, text=True,
                                       check=True, env=env).stdout.split()[-1]) for mode in ("default", "keep")}
    assert faults["default"] > 10 * 20_000
    assert faults["keep"] < 2_000
