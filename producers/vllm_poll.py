"""How long vLLM's processes poll their shared-memory queues before they sleep: a vLLM general plugin.

vLLM's multiprocess executor (the only one it runs on CPU) passes scheduler steps from the engine core to the
worker, and results back, through shared-memory ring buffers. A reader of one of them keeps polling it (a
``sched_yield`` loop) for ``busy_loop_s`` after its last read, 1 s in vLLM 0.32, and only then sleeps on a zmq
notification. Between bursts of generation the worker therefore polls for a whole second; when the generator's
bursts come more often than that (a step of the trainer every 0.1-0.2 s on a small task) it never sleeps, and on
a CPU host it takes a core from the trainer, whose every step then waits on its slowest thread
(bench/RESULTS.md, 2026-12-03: on the tiny e2e task the trainer's step took 81 ms at vLLM's 1 s, 45 ms at 2 ms).

``set_poll_s(seconds)`` (``Engine.start`` calls it) puts the wanted poll in the environment, which vLLM's engine
core and worker processes inherit; ``register()`` is the plugin that vLLM loads in each of them (entry point group
``vllm.general_plugins``, see pyproject.toml) and that sets the readers' poll from it. With the variable unset, or
with a vLLM whose queues no longer have ``SpinCondition``, it changes nothing. ``VLLM_PLUGINS``, when a user sets
it, must name ``streamforge_poll`` for the plugin to load.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

ENV = "STREAMFORGE_VLLM_POLL_S"

# the generator's default (generator.vllm_poll_s): on the tiny e2e task the step period went from 180 ms (vLLM's
# 1 s) to 110 ms at 0.02 s and 0.002 s; a poll of 0, every read woken through zmq, made generation 25x slower
DEFAULT_POLL_S = 0.02


def set_poll_s(seconds: float | None) -> None:
    """Ask the vLLM processes started after this call to poll their queues ``seconds`` (None: vLLM's own)."""
    if seconds is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = repr(float(seconds))


def poll_s() -> float | None:
    """The poll asked for in this process's environment (None: unset)."""
    raw = os.environ.get(ENV, "")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds: vLLM keeps its own poll", ENV, raw)
        return None
    return value if value >= 0 else None


def register() -> None:
    """vLLM general plugin: from now on every shared-memory reader of this process polls for ``poll_s()``."""
    seconds = poll_s()
    if seconds is None:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return
    cls = getattr(shm_broadcast, "SpinCondition", None)
    if cls is None or getattr(cls, "_streamforge_poll_s", None) == seconds:
        return
    original = getattr(cls, "_streamforge_init", cls.__init__)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self, "is_reader", False):
            self.busy_loop_s = seconds

    cls._streamforge_init = original
    cls.__init__ = __init__
    cls._streamforge_poll_s = seconds
    log.debug("vLLM shared-memory readers poll %.3f s before they sleep", seconds)
