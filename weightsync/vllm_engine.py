"""The gloo weight-transfer engine that runs inside vLLM's worker process (CPU; any host without NCCL).

It implements vLLM's ``WeightTransferEngine`` protocol and is registered as backend ``"gloo"`` through
``WeightTransferEngineFactory.register_engine`` when this module is imported, which the worker extension
(``weightsync/worker.py``, named by ``vllm_args``) makes happen in the worker before the model loads.

Protocol, driven by the generator's ``WeightReceiver`` through ``AsyncLLM``:

* ``init_weight_transfer_engine({"address", "session", "timeout_s", "host"})``: starts joining the pair group
  ``session`` at the trainer's store ``address`` on the engine's transport thread and returns at once, so the
  engine keeps generating while the rendezvous happens.
* ``weightsync_prefetch(version)`` (worker extension, via ``collective_rpc``): starts receiving the next push
  (header, then buckets) into host buffers on the transport thread. Generation continues meanwhile.
* ``start_weight_update()``: nothing (the model is only touched once the whole push is in host memory, so a
  transfer that dies half-way leaves the old weights intact; and the call may come before the engine pauses).
* ``update_weights({"version": v})``: waits (bounded) for the prefetched push, or receives it inline; then
  ``initialize_layerwise_reload``, ``model.load_weights`` with the push's Hugging Face names, and
  ``finalize_layerwise_reload`` (vLLM's post-load processing, e.g. the CPU GEMM re-dispatch) in this one call: a
  push is always the whole model, so the model is consistent when it returns and the swap's pause covers exactly
  this call.
* ``finish_weight_update()``: finalizes only if an update was left open (never, in normal operation).

A failed or timed-out receive drops the pair group (the generator re-joins) and raises ``TransferFailed``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from weightsync.collective import TransferFailed, _bcast, generator_pair, recv_push
from weightsync.wire import Snapshot

log = logging.getLogger("streamforge.weightsync.vllm_engine")

BACKEND = "gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    address: str  # trainer's rendezvous store, host:port
    session: str  # pair-group name both sides agreed on (from the join)
    timeout_s: float = 30.0
    host: str = ""  # local address for gloo's sockets ("" = derived from the store address)


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    version: int = -1  # the version the caller expects (-1 = whatever arrives)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives pushes over a 2-rank gloo group (trainer rank 0) and loads them with layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-io")
        self._pg: Future | None = None
        self._pending: Future | None = None
        self._info: GlooInitInfo | None = None
        self._loading = False
        self.last_version = -1
        self.last_bytes = 0
        self.last_receive_s = 0.0
        self.last_load_s = 0.0
        self.last_init_s = 0.0
        self.last_finalize_s = 0.0

    # -- transport (on the io thread) --------------------------------------------------------
    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown_pair()
        # a fresh transport thread per pair: a receive stuck on the old pair (until its timeout) must not delay
        # the new rendezvous
        self._io.shutdown(wait=False, cancel_futures=True)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-io")
        self._info = init_info
        self._pg = self._io.submit(generator_pair, init_info.address, init_info.session,
                                   timeout_s=init_info.timeout_s, host=init_info.host)

    def _group(self):
        if self._pg is None or self._info is None:
            raise TransferFailed("trainer", "not connected (init_weight_transfer_engine first)")
        return self._pg.result(timeout=self._info.timeout_s * 2)

    def _receive(self) -> Snapshot:
        t0 = time.perf_counter()
        snap = recv_push(self._group(), peer=f"trainer@{self._info.address if self._info else '?'}")
        self.last_receive_s = time.perf_counter() - t0
        return snap

    def prefetch(self, version: int) -> None:
        """Start receiving the next push in the background; ``update_weights`` picks it up."""
        if self._pending is None:
            self._pending = self._io.submit(self._receive)

    def raw_prefetch(self, sizes: list[int]) -> Future:
        """Receive plain buffers of ``sizes`` bytes on the transport thread, loading nothing (benchmark baseline:
        the same thread and conditions as ``prefetch``, without the push format)."""

        def recv() -> float:
            group = self._group()
            t0 = time.perf_counter()
            for n in sizes:
                _bcast(group, torch.empty(int(n), dtype=torch.uint8), "trainer")
            return time.perf_counter() - t0

        return self._io.submit(recv)

    def connected(self) -> bool:
        return self._pg is not None and self._pg.done() and self._pg.exception() is None

    # -- vLLM protocol -----------------------------------------------------------------------
    def start_weight_update(self) -> None:
        self._loading = False

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        pending, self._pending = self._pending, None
        timeout = (self._info.timeout_s if self._info else 30.0) * 2
        try:
            snap = pending.result(timeout=timeout) if pending is not None else self._receive()
        except Exception as exc:
            self.shutdown_pair()
            if isinstance(exc, TransferFailed):
                raise
            raise TransferFailed("trainer", f"{type(exc).__name__}: {exc}") from exc
        if update_info.version >= 0 and snap.version != update_info.version:
            log.warning("expected weights of version %d, received %d; loading what arrived",
                        update_info.version, snap.version)
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        t0 = time.perf_counter()
        initialize_layerwise_reload(self.model)
        self._loading = True
        t1 = time.perf_counter()
        self.model.load_weights(snap.tensors())
        t2 = time.perf_counter()
        self._finalize()
        self.last_init_s = t1 - t0
        self.last_load_s = t2 - t1
        self.last_finalize_s = time.perf_counter() - t2
        self.last_version = snap.version
        self.last_bytes = snap.nbytes

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._loading = False

    def finish_weight_update(self) -> None:
        if self._loading:
            self._finalize()

    def stats(self) -> dict[str, float]:
        return {"version": self.last_version, "bytes": self.last_bytes, "receive_s": self.last_receive_s,
                "load_s": self.last_load_s, "init_s": self.last_init_s,
                "finalize_s": self.last_finalize_s, "connected": float(self.connected())}

    def shutdown_pair(self) -> None:
        """Forget the pair group (the trainer side is dropped with it); a later init re-joins."""
        self._pg = None
        self._pending = None

    def shutdown(self) -> None:
        self.shutdown_pair()
        self._io.shutdown(wait=False, cancel_futures=True)


def register() -> None:
    """Register the engine with vLLM's factory (idempotent)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)


register()
