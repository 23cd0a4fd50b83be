"""Service lifecycle: idempotent start/stop, supervised loops, drain, and the two-stage signal runner."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runtime.lifecycle import Service
from topics.errors import RoleCrashed


class Counting(Service):
    name = "counting"

    def __init__(self, crash: bool = False) -> None:
        super().__init__()
        self.crash = crash
        self.started = self.stopped = self.drained = 0
        self.ticks = 0

    async def _start(self) -> None:
        self.started += 1

    async def _stop(self) -> None:
        self.stopped += 1

    async def drain(self) -> None:
        self.drained += 1

    def loops(self):  # type: ignore[override]
        return {"tick": self._tick()}

    async def _tick(self) -> None:
        while True:
            self.ticks += 1
            if self.crash and self.ticks == 3:
                raise ValueError("boom")
            await asyncio.sleep(0.01)


async def test_start_stop_are_idempotent() -> None:
    svc = Counting()
    await svc.start()
    await svc.start()
    await svc.stop()
    await svc.stop()
    assert (svc.started, svc.stopped) == (1, 1)
    async with Counting() as other:
        assert other.started == 1
    assert other.stopped == 1


async def test_serve_drains_then_stops_on_request() -> None:
    frozen = gc.get_freeze_count()
    svc = Counting()
    stop = asyncio.Event()
    task = asyncio.create_task(svc.serve(stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert svc.ticks > 0 and svc.drained == 1 and svc.stopped == 1
    assert gc.get_freeze_count() == frozen  # only run_service freezes the heap; in-process services do not


async def test_a_crashed_loop_stops_the_service_with_a_clear_error() -> None:
    svc = Counting(crash=True)
    with pytest.raises(RoleCrashed) as err:
        await asyncio.wait_for(svc.serve(asyncio.Event()), 5)
    assert "tick" in str(err.value) and "boom" in str(err.value)
    assert svc.stopped == 1 and svc.drained == 0


async def test_a_loop_that_ignores_its_cancellation_does_not_hang_the_stop(monkeypatch, caplog) -> None:
    from runtime import lifecycle

    monkeypatch.setattr(lifecycle, "CANCEL_TIMEOUT_S", 0.3)

    class Stubborn(Service):
        name = "stubborn"
        deaf_task: asyncio.Task | None = None
        released = False

        def loops(self):  # type: ignore[override]
            return {"deaf": self._deaf()}

        async def _deaf(self) -> None:
            self.deaf_task = asyncio.current_task()
            while not self.released:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    continue  # a swallowed cancellation (as asyncio.wait_for can when it races an event)

    svc = Stubborn()
    stop = asyncio.Event()
    task = asyncio.ensure_future(svc.serve(stop))
    await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert svc._stopped and "loop 'deaf' did not stop within" in caplog.text and "_deaf" in caplog.text
    svc.released = True  # let the stray loop end (the event loop is shared with other tests)
    assert svc.deaf_task is not None
    svc.deaf_task.cancel()
    await asyncio.wait([svc.deaf_task], timeout=1)


async def test_a_loop_that_returns_is_a_crash() -> None:
    class Returns(Service):
        def loops(self):  # type: ignore[override]
            async def done() -> None:
                return None

            return {"done": done()}

    with pytest.raises(RoleCrashed, match="returned"):
        await asyncio.wait_for(Returns().serve(), 5)


SCRIPT = textwrap.dedent("""
    import asyncio, gc, sys, threading, time
    import runtime.lifecycle as lifecycle
    from runtime.lifecycle import Service, run_service

    lifecycle.CRASH_EXIT_S = 2.0

    class Slow(Service):
        name = "slow"
        drain_timeout_s = float(sys.argv[2])
        def loops(self):
            return {"work": self.work()}
        async def _stop(self):
            if sys.argv[1] == "crash-hang":  # a collective that never returns, and a thread nobody can join
                threading.Thread(target=time.sleep, args=(600,), daemon=False).start()
                await asyncio.sleep(600)
            if sys.argv[1] == "thread":  # a pool worker blocked in a rendezvous: the interpreter would join it
                threading.Thread(target=time.sleep, args=(600,), daemon=False).start()
        async def work(self):
            print("ready", flush=True)
            print(f"frozen {gc.get_freeze_count()}", flush=True)
            while True:
                if sys.argv[1].startswith("crash"):
                    raise RuntimeError("loop failed")
                await asyncio.sleep(0.05)
        async def drain(self):
            print("draining", flush=True)
            await asyncio.sleep(float(sys.argv[3]))
            print("drained", flush=True)

    sys.exit(run_service(Slow()))
""")


def _spawn(tmp_path: Path, mode: str, drain_timeout: float, drain_time: float) -> subprocess.Popen:
    script = tmp_path / "svc.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, str(script), mode, str(drain_timeout), str(drain_time)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if not mode.startswith("crash"):
        assert proc.stdout.readline().strip() == "ready"
        frozen = proc.stdout.readline().split()
        assert frozen[0] == "frozen" and int(frozen[1]) > 1000, frozen  # run_service froze the started heap
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_drains_and_exits_zero(tmp_path: Path, sig: int) -> None:
    proc = _spawn(tmp_path, "run", 5.0, 0.1)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "drained" in out


def test_drain_is_bounded_by_its_timeout(tmp_path: Path) -> None:
    proc = _spawn(tmp_path, "run", 0.5, 30.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "draining" in out and "drained" not in out
    assert time.monotonic() - t0 < 10


def test_second_signal_forces_exit(tmp_path: Path) -> None:
    proc = _spawn(tmp_path, "run", 60.0, 60.0)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "draining"
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=20)
    assert proc.returncode == 130


def test_crashed_loop_exits_one_with_message(tmp_path: Path) -> None:
    proc = _spawn(tmp_path, "crash", 5.0, 0.0)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 1
    assert "loop 'work' stopped unexpectedly" in err and "loop failed" in err


def test_a_crashed_role_that_cannot_stop_still_exits_within_the_bound(tmp_path: Path) -> None:
    """Its stop hangs and a non-daemon thread would block the interpreter's exit: the crash's timer ends it."""
    t0 = time.monotonic()
    proc = _spawn(tmp_path, "crash-hang", 5.0, 0.0)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "loop 'work' stopped unexpectedly" in err
    assert "exiting now" in err
    assert time.monotonic() - t0 < 2.0 + 8  # CRASH_EXIT_S (2 s here) and the interpreter's start


def test_a_stopped_role_whose_thread_never_ends_still_exits_with_its_code(tmp_path: Path) -> None:
    """A normal stop, but a non-daemon thread would hold the interpreter's exit: ``arm_exit`` ends it, code 0."""
    proc = _spawn(tmp_path, "thread", 5.0, 0.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "exiting now" in err
    assert time.monotonic() - t0 < 2.0 + 6  # CRASH_EXIT_S (2 s here) after the stop


def test_run_on_uvloop_leaves_the_event_loop_policy_alone() -> None:
    """The notebook API runs ``up`` inside the caller's process: pytest's later loops must still spawn processes."""
    from runtime.lifecycle import run_on_uvloop

    before = asyncio.get_event_loop_policy()

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_on_uvloop(which()).startswith("uvloop")
    assert asyncio.get_event_loop_policy() is before
