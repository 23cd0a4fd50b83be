"""vLLM worker extension (``worker_extension_cls``): imported inside the worker process before the model loads.

Importing this module registers the gloo weight-transfer engine with vLLM's factory. Its methods are callable
from the generator through ``AsyncLLM.collective_rpc(name, ...)``:

* ``weightsync_prefetch(version)``: start receiving the next push and staging it (returns at once);
* ``weightsync_ready()``: whether that push is received and staged (non-blocking: the generator asks before it
  pauses the engine, so the pause holds only the commit);
* ``weightsync_commit(version)``: vLLM's ``start_weight_update``, ``update_weights`` and ``finish_weight_update`` on
  this worker in one call (one round trip inside the generator's pause instead of three around it), returning
  ``weightsync_stats()``;
* ``weightsync_stats()``: the last loaded version, its size, receive and load times, whether the pair group is
  up (``connected``), the staging copy built (``shadow``) and how many rehearsals it staged (``rehearsed``);
* ``weightsync_raw_prefetch(sizes)`` / ``weightsync_raw_wait()``: receive plain buffers of the given sizes over
  the same pair group on the same thread as a push, loading nothing (the benchmark's raw-broadcast baseline).
"""

from __future__ import annotations

from typing import Any

from weightsync import vllm_engine

vllm_engine.register()


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.weight_transfer_engine`` is ours)."""

    def _weightsync_engine(self) -> vllm_engine.GlooWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, vllm_engine.GlooWeightTransferEngine):
            raise TypeError("weight_transfer_config does not select the gloo engine")
        return engine

    def weightsync_prefetch(self, version: int) -> None:
        self._weightsync_engine().prefetch(version)

    def weightsync_ready(self) -> dict[str, Any]:
        return self._weightsync_engine().ready()

    def weightsync_commit(self, version: int) -> dict[str, Any]:
        """Load the prefetched push of ``version`` through vLLM's own worker protocol (start, update, finish) and
        return the stats. An update an earlier call left open (its caller timed out while this worker went on) is
        finished first."""
        if getattr(self, "_weight_update_active", False):
            self.finish_weight_update()
        self.start_weight_update()
        self.update_weights({"version": version})
        self.finish_weight_update()
        return self.weightsync_stats()

    def weightsync_stats(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, vllm_engine.GlooWeightTransferEngine):
            return engine.stats()
        return {"version": -1, "bytes": 0, "receive_s": 0.0, "load_s": 0.0, "connected": 0.0, "shadow": 0.0,
                "rehearsed": 0.0}

    def weightsync_raw_prefetch(self, sizes: list[int]) -> None:
        """Start receiving plain buffers of ``sizes`` bytes on the transport thread (returns at once)."""
        self._weightsync_raw = self._weightsync_engine().raw_prefetch(sizes)

    def weightsync_raw_wait(self) -> float:
        """Seconds the last ``weightsync_raw_prefetch`` spent receiving (waits for it, bounded)."""
        return float(self._weightsync_raw.result(timeout=120))
