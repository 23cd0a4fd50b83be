"""The pair-group weight-transfer engine that runs inside vLLM's worker process (gloo on CPU, NCCL on GPU).

It implements vLLM's ``WeightTransferEngine`` protocol and is registered as backend ``"gloo"`` through
``WeightTransferEngineFactory.register_engine`` when this module is imported, which the worker extension
(``weightsync/worker.py``, named by ``vllm_args``) makes happen in the worker before the model loads. The name is
historical: each pair's process-group backend comes with ``init_weight_transfer_engine`` (``"backend"``: ``gloo``
receives into host buffers, ``nccl`` straight into buffers on the worker's GPU, ``weightsync/collective.py``).

Protocol, driven by the generator's ``WeightReceiver`` through ``AsyncLLM``:

* ``init_weight_transfer_engine({"address", "session", "timeout_s", "host", "backend", "staged", "rehearsals"})``:
  starts joining the pair group ``session`` at the trainer's store ``address`` on the engine's transport thread and
  returns at once, so the engine keeps generating while the rendezvous happens; with ``staged``, the same thread
  then builds the staging copy and rehearses ``rehearsals`` stages of the model's own checkpoint into it
  (``weightsync/staging.py``).
* ``weightsync_prefetch(version)`` (worker extension, via ``collective_rpc``): starts receiving the next push
  (header, then buckets) on the transport thread and then *stages* it (``weightsync/staging.py``: vLLM's layerwise
  reload into a private shadow copy of the model, which builds the kernel format, e.g. CPU prepacked GEMMs).
  Generation continues meanwhile; ``weightsync_ready()`` says when the push is received and staged.
* ``start_weight_update()``: nothing (the model is only touched once the whole push is in memory, so a
  transfer that dies half-way leaves the old weights intact; and the call may come before the engine pauses).
* ``update_weights({"version": v})``: waits (bounded) for the prefetched push, or receives it inline; then, if it
  was staged, *commits* it (copies the shadow's tensors into the live model's storage and installs the processed
  GEMM closures: about a millisecond on the tiny model), else runs the layerwise reload on the live model
  (``initialize_layerwise_reload``, ``model.load_weights`` with the push's Hugging Face names,
  ``finalize_layerwise_reload``). Either way the model is consistent when it returns, and the swap's pause covers
  exactly this call.
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

from weightsync.collective import (
    NCCL_BACKENDS,
    TransferFailed,
    _bcast,
    device_of,
    generator_pair,
    recv_push,
    release,
)
from weightsync.staging import ShadowModel
from weightsync.wire import Snapshot, unshared

log = logging.getLogger("streamforge.weightsync.vllm_engine")

BACKEND = "gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    address: str  # trainer's rendezvous store, host:port
    session: str  # pair-group name both sides agreed on (from the join)
    timeout_s: float = 30.0
    host: str = ""  # local address for gloo's sockets ("" = derived from the store address)
    staged: bool = True  # stage each push in a shadow model before the pause (see weightsync/staging.py)
    backend: str = "gloo"  # the pair group's backend: "gloo" (host buffers), "nccl" or "torch-nccl" (this worker's GPU)
    rehearsals: int = 0  # times the staging copy stages the model's own checkpoint once built (staging.rehearse)


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
        self.last_reused = 0  # buckets of the last push received into the one before's buffers
        self.last_load_s = 0.0
        self.last_init_s = 0.0
        self.last_finalize_s = 0.0
        self.last_stage_s = 0.0
        self.last_commit_s = 0.0
        self._shadow: ShadowModel | None = None
        self.rehearsed = 0  # stages of the model's own checkpoint rehearsed into the staging copy
        self._raw_buffers: list[torch.Tensor] = []  # raw_prefetch's (benchmark)
        self._spare: list[torch.Tensor] = []  # the last push's host buffers, unreferenced: the next one lands there

    # -- transport (on the io thread) --------------------------------------------------------
    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown_pair()
        # a fresh transport thread per pair: a receive stuck on the old pair (until its timeout) must not delay
        # the new rendezvous
        self._io.shutdown(wait=False, cancel_futures=True)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-io")
        self._info = init_info
        self._pg = self._io.submit(generator_pair, init_info.address, init_info.session,
                                   timeout_s=init_info.timeout_s, host=init_info.host, backend=init_info.backend,
                                   device=self._buffer_device())
        if init_info.staged and self._shadow is None:  # built now, not inside the first push's receive
            self._io.submit(self._build_shadow, init_info.rehearsals)

    def _build_shadow(self, rehearsals: int = 0) -> None:
        """The staging copy of the model (on the io thread; a failure leaves it to the first staged push), then
        ``rehearsals`` stages of the model's own checkpoint into it (``ShadowModel.rehearse``)."""
        if self._shadow is not None:
            return
        try:
            self._shadow = ShadowModel(self.model, self.model_config)
        except Exception as exc:  # noqa: BLE001 - staging is an optimisation; retried at the first push
            log.warning("shadow model not built (%s: %s)", type(exc).__name__, exc)
            return
        log.info("shadow model for staged loads ready in %.1f ms", self._shadow.last_copy_s * 1000)
        if rehearsals > 0:
            try:
                times = self._shadow.rehearse(str(self.model_config.model), rehearsals)
            except Exception as exc:  # noqa: BLE001 - a rehearsal only warms: the pushes stage as before
                log.warning("staging rehearsal failed (%s: %s); the first push builds the copy again",
                            type(exc).__name__, exc)
                self._shadow = None  # a stage that failed half-way may leave it on meta tensors
                return
            self.rehearsed = len(times)
            log.info("staging rehearsed from the model's checkpoint: %s s", [round(t, 2) for t in times])

    def _group(self):
        if self._pg is None or self._info is None:
            raise TransferFailed("trainer", "not connected (init_weight_transfer_engine first)")
        return self._pg.result(timeout=self._info.timeout_s * 2)

    def _receive(self) -> Snapshot:
        t0 = time.perf_counter()
        spare, self._spare = self._spare, []
        snap = recv_push(self._group(), peer=f"trainer@{self._info.address if self._info else '?'}",
                         device=self._buffer_device(), reuse=spare)
        self.last_reused = sum(a is b for a, b in zip(snap.buffers, spare))
        self.last_receive_s = time.perf_counter() - t0
        return snap

    def _receive_and_stage(self) -> tuple[Snapshot, bool]:
        """Receive a push, then stage it in the shadow model (when enabled); returns it and whether it is staged.
        A failed staging is logged and leaves the push to the in-pause reload."""
        snap = self._receive()
        if not (self._info is not None and self._info.staged):
            return snap, False
        try:
            if snap.buffers and snap.buffers[0].is_cuda:  # staging reads the buckets on this thread's stream
                torch.cuda.current_stream(snap.buffers[0].device).synchronize()
            if self._shadow is None:
                self._build_shadow()
            if self._shadow is None:
                return snap, False
            self._shadow.stage(snap.tensors())
            if snap.buffers and snap.buffers[0].is_cuda:  # "ready" means the shadow is written
                torch.cuda.current_stream(snap.buffers[0].device).synchronize()
        except Exception as exc:  # noqa: BLE001 - staging is an optimisation; the in-pause reload still works
            log.warning("staging version %d failed (%s: %s); loading it inside the pause", snap.version,
                        type(exc).__name__, exc)
            self._shadow = None
            return snap, False
        self.last_stage_s = self._shadow.last_stage_s
        return snap, True

    def _buffer_device(self) -> torch.device:
        """Where received buckets land: host memory for gloo, this worker's GPU for nccl."""
        backend = self._info.backend if self._info else "gloo"
        return device_of(backend, self.device if backend in NCCL_BACKENDS else None)

    def prefetch(self, version: int) -> None:
        """Start receiving (and staging) the next push in the background; ``update_weights`` picks it up."""
        if self._pending is None:
            self._pending = self._io.submit(self._receive_and_stage)

    def ready(self) -> dict[str, Any]:
        """Whether the prefetched push is received and staged (non-blocking; the generator asks before pausing)."""
        pending = self._pending
        if pending is None:
            return {"pending": False, "done": False, "error": ""}
        if not pending.done():
            return {"pending": True, "done": False, "error": ""}
        exc = pending.exception()
        return {"pending": True, "done": True, "error": f"{type(exc).__name__}: {exc}" if exc else ""}

    def raw_prefetch(self, sizes: list[int]) -> Future:
        """Receive plain buffers of ``sizes`` bytes on the transport thread, loading nothing (benchmark baseline:
        the same thread and conditions as ``prefetch``, without the push format). The buffers are allocated once
        and received into again by the next call with the same sizes, as pushes reuse theirs."""

        def recv() -> float:
            group = self._group()
            device = self._buffer_device()
            if [b.numel() for b in self._raw_buffers] != [int(n) for n in sizes]:
                self._raw_buffers = [torch.empty(int(n), dtype=torch.uint8, device=device) for n in sizes]
            t0 = time.perf_counter()
            for buf in self._raw_buffers:
                _bcast(group, buf, "trainer")
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
            snap, staged = pending.result(timeout=timeout) if pending is not None else (self._receive(), False)
        except Exception as exc:
            self.shutdown_pair()
            if isinstance(exc, TransferFailed):
                raise
            raise TransferFailed("trainer", f"{type(exc).__name__}: {exc}") from exc
        if update_info.version >= 0 and snap.version != update_info.version:
            log.warning("expected weights of version %d, received %d; loading what arrived",
                        update_info.version, snap.version)
        self.last_version = snap.version
        self.last_bytes = snap.nbytes
        if staged and self._shadow is not None and self.model is self._shadow.source:
            self._shadow.commit()
            self.last_commit_s = self._shadow.last_commit_s
            self.last_init_s = self.last_load_s = self.last_finalize_s = 0.0
        else:
            self._reload(snap)
        # loaded: the buffers are kept for the next push when nothing holds a view of them (wire.unshared)
        buffers, snap = snap.buffers, None
        self._spare = unshared(buffers)

    def _reload(self, snap: Snapshot) -> None:
        """vLLM's layerwise reload of ``snap`` on the live model (inside the pause)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.last_stage_s = self.last_commit_s = 0.0
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
                "finalize_s": self.last_finalize_s, "stage_s": self.last_stage_s, "commit_s": self.last_commit_s,
                "reused_buffers": float(self.last_reused), "connected": float(self.connected()),
                "shadow": float(self._shadow is not None), "rehearsed": float(self.rehearsed)}

    def shutdown_pair(self) -> None:
        """Forget the pair group (the trainer side is dropped with it); a later init re-joins."""
        release(self._pg)
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
