"""glibc's allocator kept from unmapping the main thread's freed blocks (``keep_freed_memory``).

glibc maps a block above its mmap threshold (at most 32 MB) with ``mmap`` and unmaps it on ``free``, so a process
that allocates the same large blocks again and again faults every page of them in each time. The trainer's
weight snapshot (``weightsync.wire.pack``: every weight copied into fresh buckets, 651 MB for SmolLM2-135M, taken
on the event loop's thread, the main one) made 170k page faults a publication, 0.5-1.3 s of its 2-core host's time
beside a 2-3 s step (bench/RESULTS.md, 2026-12-05 afternoon). With ``keep_freed_memory`` the main arena serves every
block from its heap and keeps what is freed, so the next snapshot reuses the same pages: 0.1 s a publication.
The process's footprint stays at its peak (a trainer reaches it in its first steps).

A worker thread's blocks are not helped: glibc serves them from arenas of 64 MB heaps and maps anything larger
whatever the setting; the trainer's step runs in one (measured: 200-400k faults a step either way).
"""

from __future__ import annotations

import ctypes
import platform

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Main arena: no block is mmapped (so none is unmapped on free) and freed memory is never trimmed; from the
    call on. Returns whether glibc took both settings (False on another C library)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - glibc always has it
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
