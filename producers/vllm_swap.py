"""A weight swap in one call into vLLM's engine core: a vLLM general plugin.

``Engine.swap`` drives a swap from the generator's process with four calls into the engine core, each a round
trip over zmq that waits for the engine core's loop: pause the scheduler, run the load on the worker, label the
new weight version, resume. Generation is stopped from the first to the last, and on a busy CPU host each round trip
waits for a scheduler step and for the generator's own event loop: on the tiny e2e task the pause took 35 ms
(median, bench/RESULTS.md 2026-12-04) to commit 1.5 MB.

``register()`` (entry point ``streamforge_swap`` of the group ``vllm.general_plugins``, see pyproject.toml) adds
one utility method to vLLM's ``EngineCore``, ``streamforge_swap(version, mode, method, args, kwargs)``, that does
all four in the engine core: it pauses the scheduler (``mode`` as ``pause_scheduler``, caches cleared), and once the
pause is complete runs the worker RPC ``method(*args, **kwargs)``, sets the weight version to ``version`` if the RPC
succeeded, and resumes the scheduler whatever happened. It returns ``{"result": <the RPC's result>, "pause_ms",
"load_ms", "resume_ms"}`` timed inside the engine core. ``Engine.swap_rpc`` calls it, and falls back to the four
calls when the engine core lacks the method (the plugin did not load there, e.g. ``VLLM_PLUGINS`` without
``streamforge_swap``).

The plugin patches only in a process that has already imported ``vllm.v1.engine.core`` (the engine core and the
generator's process; vLLM loads general plugins in its workers too, which never call it).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger(__name__)

METHOD = "streamforge_swap"


def _resume(core: Any) -> None:
    """Resume the scheduler and wake the engine core's loop.

    A pause that waited for the scheduler to go idle completes in a callback that the loop runs just before it
    blocks on its input queue; resumed requests do not unblock it, and without the wake-up they would stand still
    until the generator's next call (seconds: the e2e task's trainer saw stalls of 4-5 s)."""
    core.resume_scheduler()
    queue = getattr(core, "input_queue", None)
    if queue is not None:
        from vllm.v1.engine import EngineCoreRequestType

        queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


def _swap(core: Any, version: str, mode: str, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The engine core's side of ``Engine.swap_rpc`` (module docstring); runs in the engine core's loop."""
    from concurrent.futures import Future

    t0 = time.perf_counter()
    pending = core.pause_scheduler(mode, True)

    def commit() -> dict[str, Any]:
        t1 = t2 = time.perf_counter()
        try:
            out = core.collective_rpc(method, args=tuple(args), kwargs=dict(kwargs) or None)
            core.set_weight_version(version)
            t2 = time.perf_counter()
        finally:
            _resume(core)
        t3 = time.perf_counter()
        return {"result": out[0] if out else None, "pause_ms": (t1 - t0) * 1000, "load_ms": (t2 - t1) * 1000,
                "resume_ms": (t3 - t2) * 1000}

    if pending is None:  # the scheduler was idle: paused at once
        return commit()
    done: Future = Future()

    def on_paused(fut: Future) -> None:  # called by the engine core's loop once the pause is complete
        try:
            fut.result()
        except BaseException as exc:  # noqa: BLE001 - the pause failed: resume, and the caller sees why
            _resume(core)
            done.set_exception(exc)
            return
        try:
            done.set_result(commit())
        except BaseException as exc:  # noqa: BLE001 - the load failed (resumed by commit): the caller sees why
            done.set_exception(exc)

    pending.add_done_callback(on_paused)
    return done


def register() -> None:
    """vLLM general plugin: give ``EngineCore`` the ``streamforge_swap`` utility method (module docstring)."""
    core_module = sys.modules.get("vllm.v1.engine.core")
    cls = getattr(core_module, "EngineCore", None)
    if cls is None or getattr(cls, METHOD, None) is not None:
        return
    if not all(hasattr(cls, name) for name in ("pause_scheduler", "resume_scheduler", "set_weight_version",
                                               "collective_rpc")):
        return
    setattr(cls, METHOD, _swap)
    log.debug("vLLM's engine core swaps weights in one call (%s)", METHOD)
