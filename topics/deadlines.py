"""Bounded awaits whose cancels are never lost (``within``, not ``asyncio.wait_for``), and ``cancel_and_wait``.

``within(awaitable, timeout_s)`` bounds an await; ``cancel_and_wait(tasks)`` ends tasks that may have dropped a cancel.

On Python 3.11 ``asyncio.wait_for`` (ours, and nats-py's inside every request and KV watch) drops a cancel of the
task that awaits it when the cancel arrives in the loop turn in which the awaited thing finishes: it returns the
result instead (CPython gh-86296, fixed in 3.12 by rebuilding ``wait_for`` on ``asyncio.timeout``). The task then
goes on to its next await, perhaps one that waits for ever (a KV watch between versions), and an owner that
cancelled it once and waits for it, as ``gather`` and 3.11's ``TaskGroup`` do, waits without end.

* ``within`` awaits in the caller's own task under ``asyncio.timeout``, where a cancel always arrives; past
  ``timeout_s`` it raises ``TimeoutError`` as ``wait_for`` did. The library awaits nothing through ``wait_for``
  (``tests/unit/test_deadlines.py`` checks both).
* ``cancel_and_wait`` cancels tasks and waits for them, cancelling again every ``every_s`` those still running: a
  dropped cancel costs ``every_s``, as the next one lands on the task's next await.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """``await aw``, raising ``TimeoutError`` once ``timeout_s`` seconds have passed (the awaitable is cancelled)."""
    async with asyncio.timeout(timeout_s):
        return await aw


async def cancel_and_wait(tasks: Iterable[asyncio.Future], timeout_s: float | None = None, *,
                          every_s: float = 0.5) -> set[asyncio.Future]:
    """Cancel ``tasks`` and wait until they have ended, cancelling again every ``every_s`` any still running, for at
    most ``timeout_s`` (None: no bound); returns those still running then. Waits on the tasks only."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        wait = every_s if deadline is None else min(every_s, deadline - time.monotonic())
        if wait <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=wait)
    return pending
