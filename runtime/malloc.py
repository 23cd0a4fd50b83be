"""A role process's memory allocator: jemalloc keeping freed memory, or glibc keeping the main thread's.

Why: glibc maps a block above its mmap threshold (at most 32 MB) with ``mmap`` and unmaps it on ``free``, and
serves every thread but the main one from arenas of 64 MB heaps that map any larger block whatever the tunables;
a process that allocates the same large blocks again and again faults every page of them in each time. Measured
with SmolLM2-135M on a 2-core host (bench/RESULTS.md, 2026-12-05 afternoon): the trainer's step (in a worker
thread) made 160-400k page faults a step, 1.0-1.5 s of kernel time in a 2.3-3.5 s step, and each publication's
651 MB weight snapshot 170k (0.5-1.3 s). Under jemalloc with its decay off every process reuses its pages: the
median time between steps went from 6.8 to 6.3 s (sync) and 5.0 to 3.4 s (async), and over three seeds both modes
reached the reward target a quarter sooner.

* ``allocator_env(choice)``: the environment ``streamforge up`` gives its role processes (``up.allocator``):
  ``auto`` = jemalloc where its library is found (``find_jemalloc``: Debian's ``libjemalloc2``), else nothing;
  ``jemalloc`` = jemalloc or a ``ConfigError`` naming the key; ``glibc`` = nothing. jemalloc goes in through
  ``LD_PRELOAD`` (before any already there) with ``MALLOC_CONF`` ``dirty_decay_ms:-1,muzzy_decay_ms:-1``: freed
  pages are never handed back, so a process's footprint stays at its peak.
* ``keep_freed_memory()``: under glibc, ``mallopt`` so the main arena maps no block and trims nothing; the trainer
  calls it (its ``own_process()``, from ``run_service``), which saves the snapshots' faults (taken on the event
  loop's thread, the main one); a no-op under jemalloc, which has no ``mallopt`` of its own and keeps freed memory
  anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from pathlib import Path

from topics.errors import ConfigError

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_jemalloc() -> str | None:
    """The path of this host's jemalloc shared library, or None."""
    for d in _LIB_DIRS:
        path = Path(d) / "libjemalloc.so.2"
        if path.exists():
            return str(path)
    name = ctypes.util.find_library("jemalloc")  # a soname: LD_PRELOAD searches the library path for it
    return name or None


def allocator_env(choice: str, *, environ: dict[str, str] | None = None,
                  jemalloc: str | None | bool = True) -> dict[str, str]:
    """The variables a role process needs for ``up.allocator`` = ``choice`` (see the module docstring); empty for
    glibc. ``environ``: the environment they are added to (default ``os.environ``); ``jemalloc``: the library's
    path, None for none on this host (default: ``find_jemalloc()``)."""
    if choice == "glibc":
        return {}
    lib = find_jemalloc() if jemalloc is True else jemalloc
    if not lib:
        if choice == "jemalloc":
            raise ConfigError("up.allocator", "is jemalloc but no libjemalloc.so.2 was found on this host "
                              "(Debian: apt-get install libjemalloc2); auto falls back to glibc")
        return {}
    environ = os.environ if environ is None else environ
    preload = " ".join(x for x in (lib, environ.get("LD_PRELOAD", "")) if x)
    return {"LD_PRELOAD": preload, "MALLOC_CONF": environ.get("MALLOC_CONF") or JEMALLOC_CONF}


def keep_freed_memory() -> bool:
    """Under glibc, from the call on: the main arena mmaps no block (so none is unmapped on free) and never trims
    freed memory. Returns whether glibc took both settings (False under another allocator or C library)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or "jemalloc" in os.environ.get(
            "LD_PRELOAD", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - glibc always has it
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
