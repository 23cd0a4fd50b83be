"""The trainer's end of each generator's pair group (collective transports): a sender thread and the group.

One ``Pair`` per joined generator: its rendezvous and every push run on the pair's own single thread, so a slow or
dead generator delays nobody else. ``queue_push`` returns an asyncio future that fails (never hangs) when the
group did not come up within ``timeout_s`` or the transfer raised; the publisher then closes the pair and fences
the generator.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from weightsync.collective import release, send_push
from weightsync.wire import Snapshot


@dataclass(slots=True)
class Pair:
    """The trainer's end of one generator's pair group: its sender thread and the group (once rendezvous is done)."""

    session: str
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "weightsync-send"))
    group: Future | None = None
    broken: bool = False

    def close(self) -> None:
        self.broken = True
        self.executor.shutdown(wait=False, cancel_futures=True)
        release(self.group)


def queue_push(pair: Pair, peer: str, snapshot: Snapshot, *, timeout_s: float) -> asyncio.Future:
    """Push ``snapshot`` on ``pair``'s thread once its group is up (waiting at most ``timeout_s`` for it); the
    future's result is the push's seconds."""

    def push() -> float:
        if pair.broken:
            raise RuntimeError("pair group already broken")
        assert pair.group is not None
        group = pair.group.result(timeout=timeout_s)
        return send_push(group, snapshot, peer=peer)

    return asyncio.wrap_future(pair.executor.submit(push))


def call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """``loop.call_soon_threadsafe`` from a pair's thread; a loop already closed (the trainer stopped while a
    rendezvous was still waiting) has nobody left to tell."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)
