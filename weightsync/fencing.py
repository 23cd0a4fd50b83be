"""The buffer's live view of fenced generators (the ``fenced`` key of the policy KV bucket, see ``members.py``).

``FenceView(nc, names)``: ``start()`` reads the current record, then ``loop()`` (supervise it) follows every change
of the key with a KV watch (waits on the watch only). ``fenced`` is ``{generator_id: last_acked_version}``;
``should_drop(generator_id, max_token_version)`` applies the rule of ``members.drop_for_fence``.
"""

from __future__ import annotations

import logging
from typing import Any

from topics.errors import MalformedMessage
from topics.names import Names
from topics.nats import OnBadMessage, PolicyStore
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

    @property
    def source(self) -> str:
        """How a value of the fencing key is named as a dead letter's ``source``."""
        return f"kv:{self.store.names.policy_bucket}/{FENCED_KEY}"

    def _apply(self, data: bytes | None) -> MalformedMessage | None:
        """Adopt the record; an unreadable one is ignored (the previous view stays) and returned as an error."""
        try:
            self.fenced = parse_fenced(data)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            log.error("unreadable fencing record ignored: %s", exc)
            return MalformedMessage(f"unreadable fencing record: {type(exc).__name__}: {exc}")
        return None

    async def loop(self, on_bad: OnBadMessage | None = None) -> None:
        """Follows the ``fenced`` key until cancelled; ``on_bad(source, value, error)`` gets an unreadable value."""
        watcher = await self.store.kv.watch(FENCED_KEY)
        try:
            async for entry in watcher:
                if entry is None:
                    continue  # the "initial values done" marker
                err = self._apply(entry.value if entry.operation is None else None)
                if err is not None and on_bad is not None:
                    await on_bad(self.source, bytes(entry.value or b""), err)
        finally:
            try:
                await watcher.stop()
            except Exception:  # noqa: BLE001, S110 - the connection may already be closed
                pass

    def should_drop(self, generator_id: str, max_token_version: int) -> bool:
        return drop_for_fence(self.fenced, generator_id, max_token_version)
