"""Which cores a role runs on: CPU lists (``"0-3"``, ``"1,3"``) parsed and applied to the role's process.

On a CPU host the generator's vLLM engine and the trainer compete for the same cores. OpenMP threads of two
processes time-slicing one core wait at each other's barriers, so giving each role its own cores (``trainer.cpus``,
``generator.cpus``) can be faster than sharing all of them. ``pin(cpus)`` restricts this process (and the children
it starts afterwards, such as vLLM's engine core and worker) to those cores; vLLM's CPU worker binds its OpenMP
threads itself, from ``VLLM_CPU_OMP_THREADS_BIND``, which the generator sets from the same list. Once its engine
has started, the generator can move its own process elsewhere (``generator.loop_cpus``: ``pin`` again, checked
against the cores it could use before the first ``pin``), leaving the engine's processes where they are.
Where the cores stay shared, ``omp_spin`` keeps a waiting OpenMP thread from spinning long on a core the other
process could use.
"""

from __future__ import annotations

import contextlib
import os

from topics.errors import ConfigError


def parse_cpus(spec: str, *, key: str = "cpus") -> list[int]:
    """Core ids of a CPU list such as ``"0-3,6"`` (sorted, unique); ``""`` is no restriction (``[]``).

    Raises ``ConfigError`` naming ``key`` for anything else."""
    if not spec.strip():
        return []
    ids: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ConfigError(key, f"{spec!r} is not a CPU list such as '0-3' or '1,3'") from None
        if a < 0 or b < a:
            raise ConfigError(key, f"{spec!r}: bad range {part.strip()!r}")
        ids.update(range(a, b + 1))
    return sorted(ids)


def available(spec: str, *, key: str = "cpus", allowed: set[int] | None = None) -> list[int]:
    """The cores of ``spec`` (``[]`` for ``""``), each one this process may use (``allowed``, default: its
    affinity now); else a ``ConfigError`` naming ``key``."""
    ids = parse_cpus(spec, key=key)
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    missing = [i for i in ids if i not in allowed]
    if missing:
        raise ConfigError(key, f"cores {missing} are not available to this process (it may use {sorted(allowed)})")
    return ids


def pin(spec: str, *, key: str = "cpus", allowed: set[int] | None = None) -> list[int]:
    """Restrict this process to the cores of ``spec`` (no-op for ``""``); returns them. A core outside ``allowed``
    (default: the cores this process may use now) is a ``ConfigError``.

    Every thread the process has now is moved (Linux keeps an affinity per thread); threads and processes it
    starts afterwards inherit it."""
    ids = available(spec, key=key, allowed=allowed)
    if not ids:
        return []
    os.sched_setaffinity(0, ids)
    for tid in _threads():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, ids)
    return ids


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        return []


def omp_spin(count: int, *, environ: dict[str, str] | None = None) -> str | None:
    """Bound how long this process's OpenMP threads busy-wait (``GOMP_SPINCOUNT``: libgomp, which torch's CPU
    wheels, MKL's GNU threading layer and oneDNN run on) before they sleep; returns the value in effect.

    Set before OpenMP loads (it reads the variable once: call this before importing torch). ``count`` -1 leaves the
    runtime's default (300,000 spins); a value already in the environment wins over ``count``. Why: a thread of a
    team waits at each barrier for its partners; when another process's engine holds a partner's core, the waiting
    thread spins on a core the engine could use (bench/RESULTS.md, 2026-12-05 night)."""
    env = os.environ if environ is None else environ
    if count >= 0 and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = str(count)
    return env.get("GOMP_SPINCOUNT")
