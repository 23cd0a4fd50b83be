"""vLLM's engine-core and worker processes forked from the generator on a CPU host, instead of spawned.

vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` while an engine's config is built, so each process
it starts (the engine core, then the engine core's worker) begins as a fresh interpreter that imports vLLM and torch
again: 7-8 s of CPU each on a 2-core host, one after the other, most of a generator's start (bench/RESULTS.md,
2026-12-05 evening). Forked, they start with what the generator already imported. ``generator.vllm_start_method``
chooses: ``auto`` (the default) forks where the platform would force spawn (CPU, vLLM's multiprocess executor,
placement not turned off with ``VLLM_CPU_OMP_THREADS_BIND=nobind``) and the process is a generator's own (below),
``spawn`` keeps vLLM's way, ``fork`` asks for it (the caller vouches that no OpenMP team ran in its process).

What spawn gave for free, fork does here:

* Thread placement. vLLM places a CPU worker's OpenMP threads through the environment it sets around the worker's
  start (``OMP_NUM_THREADS`` and ``OMP_PLACES``, or ``GOMP_CPU_AFFINITY`` / ``KMP_AFFINITY`` with a preloaded
  runtime), which an OpenMP runtime reads only when it loads; in a forked worker it loaded in the generator long
  before. ``_after_fork`` (``os.register_at_fork``) applies them in the child: the CPU affinity of its thread (the
  OpenMP threads it creates inherit it) and torch's thread count.
* A runtime that never started threads. GNU OpenMP cannot run in a child forked after its parent ran a parallel
  region (the child waits forever on the parent's team). ``auto`` therefore forks only from a process that a
  generator role owns (``streamforge run generator``: ``own_process()``, called before anything runs, sets its
  torch threads to 1, so no team ever starts there: the process tokenizes, scores and talks to the brokers, its
  model runs in the worker); an engine made inside another process (a test, a benchmark, a library user's
  program, which may have run torch in parallel already) is spawned. The engine core, forked while ``FLAG`` is
  set, keeps one torch thread too (it does not run the model under the multiprocess executor), so its own fork of
  the worker is safe.
* Plugins. vLLM loads its general plugins once per process, so a forked child keeps the generator's; ``prepare()``
  imports the engine core's module and applies ours (``producers/vllm_poll.py``, ``producers/vllm_swap.py``) in the
  generator before the fork.

``forking()`` brackets the ``AsyncLLM`` construction (which starts the engine core): the handler acts only in
children forked while it is open, and in theirs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator

log = logging.getLogger(__name__)

METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
FLAG = "STREAMFORGE_VLLM_FORKED"
_AFFINITY_ENVS = ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
_USER_METHOD = os.environ.get(METHOD_ENV)  # read before any engine config: vLLM's CPU platform overwrites it
_registered = False
_owned = False  # own_process() was called: no OpenMP team can have run in this process


def wants_fork(start_method: str, executor: str | None) -> bool:
    """Whether this engine's processes are forked: ``fork``, or ``auto`` on a CPU host with the multiprocess
    executor (``uni`` runs the model in the engine core, which vLLM's placement never covers: it keeps spawn),
    placement on, no start method the user set, in a process ``own_process()`` prepared."""
    if start_method == "spawn" or executor == "uni":
        return False
    if start_method == "fork":
        return True
    from vllm.platforms import current_platform

    return (current_platform.is_cpu() and _owned and not _USER_METHOD
            and os.environ.get("VLLM_CPU_OMP_THREADS_BIND") != "nobind")


def own_process() -> None:
    """A generator's (or an evaluator's) role process, before anything runs in it: one torch thread (no OpenMP team
    can start, so its engine's processes may be forked)."""
    global _owned
    import torch

    torch.set_num_threads(1)
    _owned = True


def prepare() -> None:
    """In the generator, before its engine's config is built: our plugins applied, and the placement handler
    registered (once per process)."""
    global _registered
    import vllm.v1.engine.core  # noqa: F401 - vllm_swap patches its EngineCore

    from producers import vllm_poll, vllm_swap

    vllm_poll.register()
    vllm_swap.register()
    if not _registered:
        os.register_at_fork(after_in_child=_after_fork)
        _registered = True


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Around the ``AsyncLLM`` construction, after its config is built (the CPU platform set spawn): vLLM starts
    its processes by fork, and those forked meanwhile (the engine core, then its worker) are placed."""
    before = os.environ.get(METHOD_ENV)
    os.environ[METHOD_ENV] = "fork"
    os.environ[FLAG] = "1"
    try:
        yield
    finally:
        os.environ.pop(FLAG, None)
        if before is None:
            os.environ.pop(METHOD_ENV, None)
        else:
            os.environ[METHOD_ENV] = before


def placement(environ: dict[str, str] | os._Environ) -> tuple[set[int], int] | None:
    """(cores, threads) that vLLM's environment asks a worker's OpenMP threads to take, or None where it asks
    nothing (only a worker's start sets both the thread count and one of the affinity variables)."""
    spec = next((environ[k] for k in _AFFINITY_ENVS if environ.get(k)), "")
    threads = environ.get("OMP_NUM_THREADS", "")
    if not spec or not threads.isdigit():
        return None
    if "proclist=[" in spec:  # KMP_AFFINITY=granularity=fine,explicit,proclist=[0,1]
        spec = spec.split("proclist=[", 1)[1].split("]", 1)[0]
    cores: set[int] = set()
    for lo, hi in re.findall(r"(\d+)(?:-(\d+))?", spec):
        cores.update(range(int(lo), int(hi or lo) + 1))
    return (cores, int(threads)) if cores and int(threads) > 0 else None


def _after_fork() -> None:
    if os.environ.get(FLAG) != "1":
        return
    import torch

    place = placement(os.environ)
    if place is None:  # the engine core: one thread, no OpenMP team before it forks its worker
        torch.set_num_threads(1)
        return
    cores, threads = place
    try:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
    except (OSError, ValueError) as exc:  # cores not in this host's set: the worker runs unplaced
        log.warning("vLLM worker placement on cores %s failed: %s", sorted(cores), exc)
