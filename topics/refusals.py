"""NATS permission refusals as typed errors: ``PermissionDenied`` at once instead of a request that times out.

nats-server answers a publish or a subscription its user may not make with an asynchronous ``-ERR 'Permissions
Violation for Publish to "<subject>"'`` (or ``Subscription to``) and drops the message; nats-py hands that to the
connection's error callback and keeps the connection, so a refused request waits out its whole timeout and a
refused subscription simply never delivers. ``topics.nats.connect`` passes every error of its connections to
``note`` here; ``guarded(nc, subjects, awaitable)`` awaits the awaitable and raises ``PermissionDenied`` (naming the
operation and subject) as soon as the server refuses, on that connection, one of ``subjects`` (exact subjects, or
prefixes ending in ``.>``). A subscription is refused after the fact: ``subscribe_checked`` subscribes, flushes
(the server answers a refused SUB before the PONG) and raises if it was refused.

nats-py lowercases the server's error text, so subjects are compared lowercased. A connection not made by
``topics.nats.connect`` records nothing: its refused calls end in their own timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from topics.errors import PermissionDenied

T = TypeVar("T")

_VIOLATION_RE = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"')


class _Watch:
    """One ``guarded`` call waiting for a refusal of one of its subjects."""

    def __init__(self, subjects: Iterable[str]) -> None:
        self.exact = set()
        self.prefixes = []
        for s in subjects:
            s = s.lower()
            if s.endswith(".>"):
                self.prefixes.append(s[:-1])
            else:
                self.exact.add(s)
        self.refused: asyncio.Future[PermissionDenied] = asyncio.get_running_loop().create_future()

    def matches(self, subject: str) -> bool:
        return subject in self.exact or any(subject.startswith(p) for p in self.prefixes)


_watches: weakref.WeakKeyDictionary[Any, list[_Watch]] = weakref.WeakKeyDictionary()


def parse(error: BaseException | str) -> tuple[str, str] | None:
    """``(operation, subject)`` of a permissions-violation error (operation ``publish`` or ``subscribe``), else
    None. The subject is as nats-py reports it: lowercased."""
    m = _VIOLATION_RE.search(str(error).lower())
    if m is None:
        return None
    return ("publish" if m.group(1) == "publish" else "subscribe"), m.group(2)


def note(nc: Any, error: BaseException) -> None:
    """An error of connection ``nc`` (its error callback): wake the ``guarded`` calls whose subject it refuses."""
    refusal = parse(error)
    if refusal is None:
        return
    operation, subject = refusal
    for watch in _watches.get(nc, ()):
        if watch.matches(subject) and not watch.refused.done():
            watch.refused.set_result(PermissionDenied(operation, subject))


async def guarded(nc: Any, subjects: Iterable[str], awaitable: Awaitable[T]) -> T:
    """The result of ``awaitable``, or ``PermissionDenied`` (the awaitable cancelled) as soon as the server refuses
    a publish or subscription of ``nc`` to one of ``subjects`` (exact, or a prefix ending ``.>``)."""
    watch = _Watch(subjects)
    _watches.setdefault(nc, []).append(watch)
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait([task, watch.refused], return_when=asyncio.FIRST_COMPLETED)
        if watch.refused.done():  # refused: even if the call also ended (a timeout, an error of its own)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise watch.refused.result()
        return task.result()
    finally:
        if not task.done():  # cancelled from outside
            task.cancel()
        watch.refused.cancel()
        watches = _watches.get(nc)
        if watches is not None:
            with contextlib.suppress(ValueError):
                watches.remove(watch)


async def subscribe_checked(nc: Any, subject: str, *, cb: Callable[[Any], Awaitable[None]] | None = None,
                            timeout_s: float = 5.0) -> Any:
    """``nc.subscribe(subject, cb=cb)``, flushed: ``PermissionDenied`` if the server refused it (the subscription
    is then removed)."""
    sub = await nc.subscribe(subject, cb=cb)
    try:
        await guarded(nc, [subject], nc.flush(timeout=timeout_s))
    except PermissionDenied:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        raise
    return sub
