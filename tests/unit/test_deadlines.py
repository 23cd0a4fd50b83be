"""``topics.deadlines.within``: a bounded await that always delivers its caller's cancel, used instead of
``asyncio.wait_for`` everywhere in the library (Python 3.11's drops a cancel that meets a finishing awaitable)."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from topics.deadlines import cancel_and_wait, within

ROOT = Path(__file__).parents[2]
LIBRARY = ("streamforge", "producers", "consumers", "buffer", "weightsync", "topics", "runtime", "services", "envs",
           "models")


async def _quick() -> int:
    return 1


async def _beating(bound) -> None:
    """Like a heartbeat: a quick bounded await after another, then a wait that only a cancel ends."""
    for _ in range(20):
        await bound(_quick(), 5)
    await asyncio.Event().wait()


async def _cancels_lost(bound) -> int:
    """Of 40 cancels, each at a different point of ``_beating``, how many the task did not end on."""
    lost = 0
    for turns in range(1, 41):
        task = asyncio.create_task(_beating(bound))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        if not (await asyncio.wait([task], timeout=0.5))[0]:
            lost += 1
            task.cancel()  # now in the endless wait, where it lands
            await asyncio.wait([task], timeout=0.5)
        assert task.done()
    return lost


async def test_within_delivers_every_cancel() -> None:
    assert await _cancels_lost(within) == 0


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 rebuilt asyncio.wait_for on asyncio.timeout")
async def test_the_same_cancels_are_lost_under_python_311_wait_for() -> None:
    # the scenario above does reach the race: the awaitable finishes in the turn the cancel arrives
    assert await _cancels_lost(asyncio.wait_for) > 0


async def test_within_returns_the_result_and_bounds_the_wait() -> None:
    assert await within(_quick(), 1) == 1
    started = asyncio.Event()

    async def slow() -> None:
        started.set()
        await asyncio.sleep(30)

    task = asyncio.ensure_future(slow())
    with pytest.raises(TimeoutError):
        await within(task, 0.05)
    assert started.is_set() and task.cancelled()  # the awaitable is cancelled past the bound, as wait_for did


def test_the_library_awaits_nothing_through_wait_for() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}" for pkg in LIBRARY for path in sorted((ROOT / pkg).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\basyncio\.wait_for\(", line)]
    assert not found, f"use topics.deadlines.within instead of asyncio.wait_for at {found}"


async def test_cancel_and_wait_ends_a_task_that_dropped_its_cancel() -> None:
    dropped = asyncio.Event()

    async def drops_one() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            dropped.set()  # as 3.11's wait_for does when its awaitable finished in the same turn
        await asyncio.Event().wait()  # the next await, where the next cancel lands

    task = asyncio.create_task(drops_one())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], 5, every_s=0.05) == set()
    assert dropped.is_set() and task.cancelled()


async def test_cancel_and_wait_returns_what_ignores_every_cancel() -> None:
    deaf_until = asyncio.Event()

    async def deaf() -> None:
        while not deaf_until.is_set():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(deaf())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], 0.3, every_s=0.05) == {task}
    assert not task.done()
    deaf_until.set()  # it ends at its next wake-up: no task outlives the test
    assert await cancel_and_wait([task], 5, every_s=0.05) == set()
