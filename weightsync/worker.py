"""vLLM worker extension (``worker_extension_cls``): imported inside the worker process before the model loads.

Importing this module registers the gloo weight-transfer engine with vLLM's factory. Its methods are callable
from the generator through ``AsyncLLM.collective_rpc(name, ...)``:

* ``weightsync_prefetch(version)``: start receiving the next push into host memory (returns at once);
* ``weightsync_stats()``: the last loaded version, its size, receive and load times;
* ``weightsync_raw_recv(sizes)``: receive plain buffers of the given sizes over the same pair group, without
  loading anything (the benchmark's raw-broadcast baseline); returns seconds.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from weightsync import vllm_engine
from weightsync.collective import _bcast

vllm_engine.register()


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.weight_transfer_engine`` is ours)."""

    def _weightsync_engine(self) -> vllm_engine.GlooWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, vllm_engine.GlooWeightTransferEngine):
            raise RuntimeError("weight_transfer_config does not select the gloo engine")
        return engine

    def weightsync_prefetch(self, version: int) -> None:
        self._weightsync_engine().prefetch(version)

    def weightsync_stats(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, vllm_engine.GlooWeightTransferEngine):
            return engine.stats()
        return {"version": -1, "bytes": 0, "receive_s": 0.0, "load_s": 0.0, "connected": 0.0}

    def weightsync_raw_recv(self, sizes: list[int]) -> float:
        group = self._weightsync_engine()._group()
        t0 = time.perf_counter()
        for n in sizes:
            _bcast(group, torch.empty(int(n), dtype=torch.uint8), "trainer")
        return time.perf_counter() - t0
