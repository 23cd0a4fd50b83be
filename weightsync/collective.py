"""Point-to-point weight pushes over 2-rank groups, one group per generator.

One code path for three backends: ``gloo`` (CPU tensors, any host), ``nccl`` (vLLM's own NCCL communicator,
``PyNcclCommunicator``, in ``weightsync/pynccl.py``) and ``torch-nccl`` (torch's ``ProcessGroupNCCL``, for a
trainer host without vLLM). With either NCCL backend the trainer's snapshot buckets on its GPU are broadcast
straight into buffers on the generator's GPU, no host copy. Only the group class and the device of the buffers
differ; on CPU the same code runs over gloo.

Why a pair group per generator and not one group of all of them (as vLLM's own ``NCCLWeightTransferEngine``
makes): generators join, leave and die while the trainer runs. A collective over a group with a dead member fails
for every member, and re-forming one big group on every membership change stalls everyone. A 2-rank group
(trainer rank 0, generator rank 1) breaks alone when its generator dies; the trainer drops it and the generator
forms a new one when it re-joins.

Rendezvous: the trainer runs one ``TCPStore`` server (``Rendezvous``); each pair uses a ``PrefixStore`` named by a
session string both sides know (the generator's join message), so pairs never mix keys. Every call here is bounded
by the timeout given at group creation, so no caller can hang on a dead peer: gloo raises after it; ``nccl`` pairs
poll a CUDA event until the timeout, then abort the communicator (``weightsync/pynccl.py``); ``torch-nccl`` groups
are made with ``TORCH_NCCL_BLOCKING_WAIT=1`` (``wait()`` blocks the calling thread and raises at the timeout) and
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (a timed-out communicator is aborted, the process lives on), both set only
if the environment does not set them already.

Status of the NCCL backends: written to the same protocol and exercised by a CUDA test
(``tests/integration/test_weightsync_collective.py``, skipped without two CUDA devices, since NCCL refuses two
ranks on one GPU); they have not been run on a GPU yet. The gloo path is the one tested in CI.

Messages of one push, all broadcasts from rank 0 (see ``weightsync/wire.py``): a ``PREAMBLE``-byte message with the
header's length (int64) and the header itself when it fits (else the header follows as its own message), then each
bucket. ``recv_push`` returns the layout and the received buckets.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from topics.errors import TimeoutExpired
from weightsync.config import COLLECTIVE_TRANSPORTS, NCCL_TRANSPORTS
from weightsync.errors import TransferFailed
from weightsync.pynccl import PyNcclPair
from weightsync.wire import Layout, Snapshot

log = logging.getLogger("streamforge.weightsync.collective")


class Rendezvous:
    """The trainer's TCPStore server that generators' pair groups meet at (``address`` = "host:port")."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 30.0) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self._store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)
        self.port = self._store.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def store(self, session: str) -> PrefixStore:
        return PrefixStore(f"pair/{session}", self._store)

    def close(self) -> None:
        self._store = None  # type: ignore[assignment]


NCCL_BACKENDS = NCCL_TRANSPORTS  # vLLM's PyNcclCommunicator (weightsync/pynccl.py) | torch's ProcessGroupNCCL
BACKENDS = COLLECTIVE_TRANSPORTS


def nccl_usable() -> bool:
    """Whether this process can make NCCL pair groups (a CUDA device and a torch built with NCCL)."""
    return torch.cuda.is_available() and torch.distributed.is_nccl_available()


def _gloo_options(host: str, timeout_s: float) -> ProcessGroupGloo._Options:
    opts = ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)] if host else [
        ProcessGroupGloo.create_default_device()]
    opts._threads = 2
    return opts


def _group(store, rank: int, *, backend: str, host: str, timeout_s: float, peer: str = "pair",
           device: torch.device | str | None = None):
    """A 2-rank group of ``backend`` on ``store``; every collective on it is bounded by ``timeout_s``. ``device``:
    the CUDA device of an ``nccl`` pair's communicator (default: the calling thread's current one)."""
    if backend == "gloo":
        return ProcessGroupGloo(store, rank, 2, _gloo_options(host, timeout_s))
    if backend in NCCL_BACKENDS and not nccl_usable():
        raise TransferFailed(peer, f"the {backend} backend needs a CUDA device and a torch built with NCCL")
    if backend == "nccl":
        return PyNcclPair.connect(store, rank, timeout_s=timeout_s, device=device_of(backend, device), peer=peer)
    if backend == "torch-nccl":
        from torch.distributed import ProcessGroupNCCL

        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")  # wait() blocks this thread, raises at the timeout
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort a timed-out pair, keep the process
        opts = ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        return ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"unknown pair backend {backend!r} (expected one of {BACKENDS})")


def device_of(backend: str, device: torch.device | str | None = None) -> torch.device:
    """Where a pair's buffers live: the given CUDA device (default, or given without an index: the current one) for
    nccl and torch-nccl, CPU for gloo."""
    if backend in NCCL_BACKENDS:
        dev = torch.device(device) if device is not None else torch.device("cuda")
        return dev if dev.index is not None else torch.device(dev.type, torch.cuda.current_device())
    return torch.device("cpu")


def trainer_pair(rdzv: Rendezvous, session: str, *, timeout_s: float, backend: str = "gloo",
                 device: torch.device | str | None = None):
    """Rank 0 of the pair ``session``; blocks until the generator connects or ``timeout_s`` passes."""
    try:
        return _group(rdzv.store(session), 0, backend=backend, host=rdzv.host, timeout_s=timeout_s, peer=session,
                      device=device)
    except RuntimeError as exc:
        raise TransferFailed(session, f"rendezvous: {exc}") from exc


def generator_pair(address: str, session: str, *, timeout_s: float, host: str = "", backend: str = "gloo",
                   device: torch.device | str | None = None):
    """Rank 1 of the pair ``session`` against the trainer's store at ``address``; bounded by ``timeout_s``."""
    store_host, _, port = address.rpartition(":")
    try:
        store = TCPStore(store_host, int(port), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)
        local = host or ("127.0.0.1" if store_host in ("127.0.0.1", "localhost") else "")
        return _group(PrefixStore(f"pair/{session}", store), 1, backend=backend, host=local, timeout_s=timeout_s,
                      peer=address, device=device)
    except (RuntimeError, ValueError) as exc:
        raise TransferFailed(address, f"rendezvous {session}: {exc}") from exc


def release(group: Future | None) -> None:
    """Let go of a pair group (a future of one): an ``nccl`` pair's communicator is aborted, so its GPU memory and
    NCCL threads go with it; gloo and torch-nccl groups are freed with their last reference. Returns at once (the
    abort runs on a thread of its own: callers include the trainer's event loop)."""
    if group is not None and group.done() and not group.cancelled() and group.exception() is None:
        pg = group.result()
        if isinstance(pg, PyNcclPair):
            threading.Thread(target=pg.abort, name=f"pynccl-abort-{pg.peer}", daemon=True).start()


def _bcast(pg, tensor: torch.Tensor, peer: str) -> None:
    """Broadcast ``tensor`` from rank 0 and wait (bounded by the group's timeout; see the module docstring)."""
    if isinstance(pg, PyNcclPair):
        pg.broadcast(tensor, peer)
        return
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    try:
        pg.broadcast([tensor], opts).wait()
    except RuntimeError as exc:
        msg = str(exc)
        if "imeout" in msg or "timed out" in msg:
            raise TimeoutExpired(f"weight transfer with {peer} timed out: {msg.splitlines()[0]}") from exc
        raise TransferFailed(peer, msg.splitlines()[0] if msg else type(exc).__name__) from exc


PREAMBLE = 16 * 1024  # bytes: 8-byte header length, then the header itself when it fits


def send_push(pg, snapshot: Snapshot, *, peer: str = "generator") -> float:
    """Send one snapshot (preamble with the header, then buckets) as rank 0; returns seconds spent. The messages
    go from the device of the snapshot's buckets (CPU for gloo, the trainer's GPU for nccl). Raises
    ``TransferFailed`` or ``TimeoutExpired`` (bounded by the group's timeout)."""
    t0 = time.perf_counter()
    device = snapshot.buffers[0].device if snapshot.buffers else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL runs on this thread's current device
    header = snapshot.layout.to_header()
    preamble = torch.zeros(PREAMBLE, dtype=torch.uint8)
    preamble[:8].view(torch.int64)[0] = len(header)
    if len(header) <= PREAMBLE - 8:
        preamble[8:8 + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    _bcast(pg, preamble.to(device), peer)
    if len(header) > PREAMBLE - 8:
        _bcast(pg, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), peer)
    for buf in snapshot.buffers:
        if buf.numel():
            _bcast(pg, buf, peer)
    return time.perf_counter() - t0


def recv_header(pg, *, peer: str = "trainer", device: torch.device | str = "cpu") -> Layout:
    """Receive the header of a push as rank 1 (one message unless the header exceeds the preamble) into buffers on
    ``device`` (the pair's: CPU for gloo, this generator's GPU for nccl); parsed on the host."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)  # NCCL runs on this thread's current device
    preamble = torch.empty(PREAMBLE, dtype=torch.uint8, device=device)
    _bcast(pg, preamble, peer)
    preamble = preamble.cpu()
    n = int(preamble[:8].view(torch.int64)[0])
    if n <= PREAMBLE - 8:
        raw = preamble[8:8 + n]
    else:
        raw = torch.empty(n, dtype=torch.uint8, device=device)
        _bcast(pg, raw, peer)
        raw = raw.cpu()
    return Layout.from_header(raw.numpy().tobytes())


def recv_buckets(pg, layout: Layout, *, peer: str = "trainer", device: torch.device | str = "cpu",
                 reuse: Sequence[torch.Tensor] = ()):
    """Yield ``(bucket_index, buffer)`` as each bucket of the push arrives on ``device`` (rank 1).

    ``reuse``: buffers of an earlier push (``wire.unshared``) that a bucket of the same size and device is received
    into instead of fresh memory. Host memory fresh from the allocator is faulted in page by page as the bytes
    arrive: a 189 MB push into fresh buffers ran at 0.2-0.9 GB/s, into reused ones at 2.1 GB/s (bench/RESULTS.md,
    2026-12-04)."""
    dev = torch.device(device)
    for i, nbytes in enumerate(layout.buckets):
        old = reuse[i] if i < len(reuse) else None
        fits = old is not None and old.numel() == nbytes and old.device == dev and old.dtype == torch.uint8
        buf = old if fits else torch.empty(nbytes, dtype=torch.uint8, device=device)
        if nbytes:
            _bcast(pg, buf, peer)
        yield i, buf


def recv_push(pg, *, peer: str = "trainer", device: torch.device | str = "cpu",
              reuse: Sequence[torch.Tensor] = ()) -> Snapshot:
    """Receive a whole push into buffers on ``device`` (rank 1): ``reuse``'s where they fit, else fresh ones."""
    layout = recv_header(pg, peer=peer, device=device)
    return Snapshot(layout=layout, buffers=[b for _, b in recv_buckets(pg, layout, peer=peer, device=device,
                                                                       reuse=reuse)])


def raw_broadcast(pg, buffers: list[torch.Tensor], *, peer: str = "peer") -> float:
    """Broadcast the given buffers from rank 0 with nothing else (the benchmark's baseline); returns seconds."""
    t0 = time.perf_counter()
    for buf in buffers:
        if buf.numel():
            _bcast(pg, buf, peer)
    return time.perf_counter() - t0
