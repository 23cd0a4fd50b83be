"""Staged loading: prepare a new version in a private copy of the model while the engine generates, then commit it
inside the pause with plain copies.

vLLM's layerwise reload (``initialize_layerwise_reload`` / ``model.load_weights`` / ``finalize_layerwise_reload``)
turns checkpoint-format tensors (Hugging Face names: separate q/k/v, gate/up) into the model's kernel format (fused
qkv and gate_up, and on CPU each linear layer's prepacked GEMM: a oneDNN handle or a packed weight held by the
layer's ``cpu_linear`` closure). On the tiny model that processing is most of the 20-30 ms a reload takes, and run
on the live model it must happen inside the pause (the live model is on meta tensors half-way through).

``ShadowModel(model, model_config)`` runs exactly that reload, unchanged, on a *shadow*: a deep copy of the live
model made once (the KV cache tensors are shared, never copied; the shadow is never run, so its attention layers
never touch them). Per version:

* ``stage(named_tensors)``: layerwise reload into the shadow (any thread; the live model is not touched, so the
  engine keeps generating);
* ``commit(live)``: inside the pause, for every module, copy each parameter and buffer of the shadow into the live
  tensor's storage (``copy_``: the storage the engine and any captured graph hold stays the same) and install the
  functions the processing attached to the shadow's layers (``cpu_linear``). Below a millisecond on the tiny model.

The closures installed in the live model own their packed weights (the processing builds them from freshly
materialised tensors, never from the shadow's persistent ones), so restaging the shadow for the next version does
not disturb the live model; the vLLM CPU integration test checks that generation between a stage and its commit
still uses the committed weights.

Limit: processing that keeps state on a layer other than parameters, buffers and plain functions (say a packed
tensor stored as a bare attribute) would not be carried over by ``commit``. vLLM's unquantized CPU layers keep
theirs in those three (the tests cover the tiny Llama on CPU); on GPU unquantized layers keep plain parameters. A
model that does otherwise runs with staging off.

Cost: one more copy of the model's weights in the worker's memory (on a GPU, in device memory next to vLLM's
reservation: leave room for it below ``gpu_memory_utilization``), made once, when the generator joins its trainer
(or at the first staged version). ``rehearse`` then stages the model's own checkpoint into it
(``WeightSyncConfig.staged_rehearsals`` times), so the first versions do not pay for the memory a stage touches.
``WeightSyncConfig.staged_load=False`` turns staging off (the reload then runs on the live model inside the pause,
as vLLM's own ``reload_weights`` does).
"""

from __future__ import annotations

import copy
import logging
import sys
import time
import types
from collections.abc import Iterable
from pathlib import Path

import torch

log = logging.getLogger("streamforge.weightsync.staging")


def _owned_meta(meta: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module) -> torch.Tensor:
    """A private copy of one of vLLM's restore-metadata meta tensors for the shadow layer.

    vLLM's reload registers the metadata tensor itself on the layer and wraps its ``weight_loader`` in place, so
    the live layer's metadata cannot be shared: loaders bound to (or wrapped for) the live layer are rebound to the
    shadow layer here."""
    out = torch.empty_strided(meta.size(), meta.stride(), dtype=meta.dtype, device="meta")
    out.__class__ = meta.__class__
    attrs = {}
    for key, value in meta.__dict__.items():
        while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
            value = value.__wrapped__
        if isinstance(value, types.MethodType) and value.__self__ is live:
            value = value.__func__.__get__(shadow)
        attrs[key] = value
    out.__dict__ = attrs
    return out


class ShadowModel:
    """A staging copy of a vLLM model; see the module docstring."""

    def __init__(self, model: torch.nn.Module, model_config) -> None:
        # vLLM's per-layer restore metadata, recorded when it loaded the model (so the module is imported by then;
        # a model vLLM never loaded has none to copy)
        layerwise = sys.modules.get("vllm.model_executor.model_loader.reload.layerwise")
        infos = layerwise.LAYERWISE_INFO if layerwise is not None else {}
        t0 = time.perf_counter()
        memo: dict[int, object] = {}
        for module in model.modules():
            kv = getattr(module, "kv_cache", None)
            if kv is not None:  # the KV cache: shared, never copied (the shadow never runs)
                memo[id(kv)] = kv
        self.source = model
        self.model = copy.deepcopy(model, memo)
        self.model_config = model_config
        live_modules = list(model.modules())
        shadow_modules = list(self.model.modules())
        if len(live_modules) != len(shadow_modules):
            raise RuntimeError("the shadow copy of the model has a different module tree")
        for live, shadow in zip(live_modules, shadow_modules, strict=True):
            info = infos.get(live)
            if info is None:
                continue
            params, buffers = info.restore_metadata
            mine = layerwise.get_layerwise_info(shadow)
            mine.restore_metadata = ({k: _owned_meta(t, live, shadow) for k, t in params.items()},
                                     {k: _owned_meta(t, live, shadow) for k, t in buffers.items()})
            mine.restore_device = info.restore_device
        self._pairs = list(zip(live_modules, shadow_modules, strict=True))
        self.staged = False
        self.last_copy_s = time.perf_counter() - t0
        self.last_stage_s = 0.0
        self.last_commit_s = 0.0

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-format tensors into the shadow with vLLM's layerwise reload (the live model is untouched)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        t0 = time.perf_counter()
        self.staged = False
        with torch.no_grad():
            initialize_layerwise_reload(self.model)
            self.model.load_weights(named_tensors)
            finalize_layerwise_reload(self.model, self.model_config)
        self.staged = True
        self.last_stage_s = time.perf_counter() - t0

    def rehearse(self, checkpoint_dir: str, rounds: int) -> list[float]:
        """Stage the model's own checkpoint (``checkpoint_dir``'s safetensors, as vLLM loaded them) ``rounds`` times
        and leave nothing staged: each stage allocates the kernel-format weights anew, so the first versions stage
        into memory not yet touched and through first-time paths (1.65 s and 1.05 s for SmolLM2's first two
        against 0.3 s later, bench/RESULTS.md), on the swap's path and beside a trainer step. Rehearsed at the join,
        while the trainer waits for its first batch, they are paid there. Returns each round's seconds (none
        without safetensors)."""
        from safetensors import safe_open

        files = sorted(Path(checkpoint_dir).glob("*.safetensors"))

        def tensors() -> Iterable[tuple[str, torch.Tensor]]:
            for path in files:
                with safe_open(str(path), framework="pt") as fh:
                    for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                        yield name, fh.get_tensor(name)

        times = []
        for _ in range(rounds if files else 0):
            self.stage(tensors())
            times.append(self.last_stage_s)
        self.staged = False
        return times

    def commit(self) -> int:
        """Copy the staged version into the live model (inside the pause); returns how many items were set."""
        if not self.staged:
            raise RuntimeError("nothing staged")
        t0 = time.perf_counter()
        n = 0
        with torch.no_grad():
            for live, shadow in self._pairs:
                for group in ("_parameters", "_buffers"):
                    mine = getattr(shadow, group)
                    for name, tensor in getattr(live, group).items():
                        new = mine.get(name)
                        if tensor is None or new is None or new is tensor:
                            continue
                        if new.shape != tensor.shape or new.dtype != tensor.dtype:
                            raise RuntimeError(f"staged {name} is {tuple(new.shape)} {new.dtype}, the live one "
                                               f"{tuple(tensor.shape)} {tensor.dtype}")
                        tensor.data.copy_(new)
                        n += 1
                for name, fn in _functions(shadow).items():
                    if live.__dict__.get(name) is not fn:
                        live.__dict__[name] = fn
                        n += 1
        self.staged = False
        self.last_commit_s = time.perf_counter() - t0
        return n


def _functions(module: torch.nn.Module) -> dict[str, types.FunctionType]:
    """Plain functions set on a module instance (what weight processing attaches, e.g. CPU ``cpu_linear``)."""
    return {k: v for k, v in module.__dict__.items() if isinstance(v, types.FunctionType)}
