"""The buffer's live view of fenced generators (the ``fenced`` key of the policy KV bucket, see ``members.py``).

``FenceView(nc, names)``: ``start()`` reads the current record, then ``loop()`` (supervise it) follows every change
of the key with a KV watch (waits on the watch only). ``fenced`` is ``{generator_id: last_acked_version}``;
``should_drop(generator_id, max_token_version)`` applies the rule of ``members.drop_for_fence``.
"""

from __future__ import annotations

import logging
from typing import Any

from topics.names import Names
from topics.nats import PolicyStore
from weightsync.members import FENCED_KEY, drop_for_fence, parse_fenced

log = logging.getLogger("streamforge.weightsync.fencing")


class FenceView:
    """Which generators are fenced, kept current from the policy bucket."""

    def __init__(self, nc: Any, names: Names) -> None:
        self.store = PolicyStore(nc, names)
        self.fenced: dict[str, int] = {}

    async def start(self) -> None:
        await self.store.start()
        self._apply(await self.store.get(FENCED_KEY))

    def _apply(self, data: bytes | None) -> None:
        try:
            self.fenced = parse_fenced(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.error("unreadable fencing record ignored: %s", exc)

    async def loop(self) -> None:
        """Follows the ``fenced`` key until cancelled."""
        watcher = await self.store.kv.watch(FENCED_KEY)
        try:
            async for entry in watcher:
                if entry is None:
                    continue  # the "initial values done" marker
                self._apply(entry.value if entry.operation is None else None)
        finally:
            try:
                await watcher.stop()
            except Exception:  # noqa: BLE001, S110 - the connection may already be closed
                pass

    def should_drop(self, generator_id: str, max_token_version: int) -> bool:
        return drop_for_fence(self.fenced, generator_id, max_token_version)
