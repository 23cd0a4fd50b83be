"""The typed errors of weight synchronisation."""

from __future__ import annotations

from topics.errors import StreamforgeError


class TransferFailed(StreamforgeError):
    """A weight push over a pair group failed or timed out; the group is unusable afterwards."""

    retriable = True

    def __init__(self, peer: str, detail: str) -> None:
        super().__init__(f"weight transfer with {peer} failed: {detail}")
        self.peer = peer
        self.detail = detail
