"""The one lifecycle every role and client shares, and the process runner with two-stage signals.

``Service``: ``start()`` and ``stop()`` are idempotent, ``async with`` starts and stops, and ``serve(stop)``
supervises the service's long-running loops: it returns when ``stop`` is set (after ``drain()`` and at most
``drain_timeout_s``), and raises ``RoleCrashed`` as soon as any loop returns or raises while not stopping: a
crashed loop stops the role with a clear message, it never leaves the process hanging.

``run_service(service)`` is what ``streamforge run <role>`` calls: uvloop event loop; the first SIGINT/SIGTERM
drains gracefully (bounded by ``drain_timeout_s``), the second forces exit (code 130); a crashed loop exits 1, and
within ``CRASH_EXIT_S`` of the crash whatever it holds: the crash arms a timer that ends the process hard
(``os._exit``) if closing its clients, joining its threads (a gloo or NCCL collective, a thread pool) or the
interpreter's own shutdown takes longer. A role never lingers half-dead after a failure. A role that stopped
normally gets the same bound on its interpreter's shutdown (``arm_exit``), with its own exit code.
Once the role has started it collects and freezes the heap (``gc.freeze``): everything start-up made (modules,
clients, a model) moves to the collector's permanent generation, so its full passes scan only what the loops
create. In the buffer role the collector scanning the start-up heap again and again had cost about a seventh of
its CPU. A frozen object is still freed when its last reference goes; only cyclic garbage made before the freeze
is never reclaimed, and start-up makes that once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Coroutine
from typing import Any, Self

from topics.deadlines import cancel_and_wait, within
from topics.errors import RoleCrashed

log = logging.getLogger("streamforge.lifecycle")

EXIT_OK = 0
EXIT_CRASHED = 1
EXIT_FORCED = 130
CANCEL_TIMEOUT_S = 10.0  # how long serve waits for its cancelled loops to end
CRASH_EXIT_S = 10.0  # a crashed role's process ends (code 1) at most this long after the crash


class Service:
    """Base class: subclasses implement ``_start``, ``_stop``, ``loops`` and optionally ``drain``."""

    name: str = "service"
    drain_timeout_s: float = 20.0

    def __init__(self) -> None:
        self._started = False
        self._stopped = False
        self._stopping = asyncio.Event()

    # -- overridables -------------------------------------------------------------------------
    def own_process(self) -> None:
        """Process-wide settings a service may make only when the process is its own (``run_service`` calls this
        before the event loop starts; a service run inside another process never gets it)."""

    async def _start(self) -> None:
        """Connect clients, create resources."""

    async def _stop(self) -> None:
        """Flush and close clients. Called once, after the loops ended."""

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        """The long-running loops to supervise, by name. A loop that returns before ``stop`` is a crash."""
        return {}

    async def drain(self) -> None:
        """Called on graceful stop before loops are cancelled: stop taking input, finish what is in flight."""

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        await self._start()

    async def stop(self) -> None:
        if not self._started or self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        await self._stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def serve(self, stop: asyncio.Event | None = None, *, freeze_heap: bool = False,
                    on_crash: Callable[[RoleCrashed], None] | None = None) -> None:
        """Start, run every loop supervised until ``stop`` is set or a loop ends, then drain and stop.

        ``freeze_heap``: once started, collect and ``gc.freeze()`` (module docstring); for a process's main
        service only (``run_service``), never for services that come and go inside one process. ``on_crash`` is
        called as soon as a loop crashed, before anything is stopped (``run_service`` arms its exit timer)."""
        stop = stop or asyncio.Event()
        await self.start()
        if freeze_heap:
            gc.collect()
            gc.freeze()
        tasks = {asyncio.ensure_future(coro): name for name, coro in self.loops().items()}
        stopper = asyncio.ensure_future(stop.wait())
        crash: RoleCrashed | None = None
        try:
            done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is stopper:
                    continue
                exc = task.exception() if not task.cancelled() else asyncio.CancelledError()
                crash = RoleCrashed(self.name, tasks[task], exc)
                log.error("%s", crash)
                if on_crash is not None:
                    on_crash(crash)
                break
            self._stopping.set()
            if crash is None:
                try:
                    await within(self.drain(), self.drain_timeout_s)
                except TimeoutError:
                    log.warning("%s: drain did not finish within %.1f s", self.name, self.drain_timeout_s)
        finally:
            stopper.cancel()
            stuck = await cancel_and_wait(tasks, CANCEL_TIMEOUT_S)  # cancelled again while one runs on
            for task in stuck:  # a loop that ignores its cancellation: say where it hangs, then go on
                where = "".join(traceback.format_stack(task.get_stack(limit=1)[-1])) if task.get_stack() else "?"
                log.error("%s: loop %r did not stop within %.0f s of its cancellation, at:\n%s", self.name,
                          tasks[task], CANCEL_TIMEOUT_S, where)
            await self.stop()
        if crash is not None:
            raise crash


def install_uvloop() -> None:
    """Every role process runs on uvloop's event loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_on_uvloop(coro: Any) -> Any:
    """``asyncio.run(coro)`` on a uvloop event loop, leaving the process's event-loop policy alone (the notebook API
    and the CLI's commands run in processes, pytest's among them, whose other loops must stay what they were)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def run_service(service: Service, *, use_uvloop: bool = True) -> int:
    """Run a service as this process's main job; returns the process exit code. The service's ``own_process()``
    runs first (process-wide settings such as the trainer's allocator, the generator's torch threads)."""
    if use_uvloop:
        install_uvloop()
    service.own_process()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        signals = 0

        def on_signal(signum: int) -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                log.warning("%s: %s received, draining (again to force)", service.name, signal.Signals(signum).name)
                stop.set()
            else:
                log.error("%s: second signal, forcing exit", service.name)
                sys.stderr.flush()
                os._exit(EXIT_FORCED)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await service.serve(stop, freeze_heap=True, on_crash=arm_crash_exit)
        except RoleCrashed:
            return EXIT_CRASHED
        except BaseException as exc:  # a failed start: the same bound on how long the process may linger
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                arm_crash_exit(exc)
            raise
        return EXIT_OK

    code = asyncio.run(main())
    arm_exit(code)
    return code


def arm_exit(code: int, seconds: float | None = None) -> None:
    """After a role stopped: end the process with ``code`` in ``CRASH_EXIT_S`` if the interpreter's shutdown (which
    joins every non-daemon thread: a thread pool's worker blocked in a gloo rendezvous, say) has not ended it by
    then. Idempotent (a crash's timer stands)."""
    _arm_timer(code, CRASH_EXIT_S if seconds is None else seconds, "the role stopped")


def arm_crash_exit(crash: BaseException, seconds: float | None = None) -> None:
    """Say why the role stops, then end the process (exit code 1) in ``CRASH_EXIT_S`` unless it has ended by
    itself. Idempotent."""
    if _exit_timer is None:
        print(f"streamforge: {crash}", file=sys.stderr, flush=True)
    _arm_timer(EXIT_CRASHED, CRASH_EXIT_S if seconds is None else seconds, "the failure")


_exit_timer: threading.Timer | None = None


def _arm_timer(code: int, wait: float, after: str) -> None:
    """A daemon timer (a clean exit is never delayed by it) that flushes and ``os._exit(code)``s; the first armed
    stands."""
    global _exit_timer
    if _exit_timer is not None:
        return

    def hard_exit() -> None:
        log.error("still running %.0f s after %s: exiting now", wait, after)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    _exit_timer = threading.Timer(wait, hard_exit)
    _exit_timer.daemon = True
    _exit_timer.start()
