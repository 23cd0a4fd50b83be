"""Weight sync: the trainer's new policy versions into the generators' running vLLM engines.

* ``vllm_args(cfg)``: the engine keyword arguments a generator's ``Engine`` needs (worker extension and, for the
  collective transports, ``weight_transfer_config``).
* ``WeightPublisher`` (trainer, ``publisher.py``) and ``WeightReceiver`` (generator, ``receiver.py``).
* Transports: ``gloo`` and ``nccl`` (pair groups over torch.distributed, ``collective.py``: the same code, gloo
  through host memory, NCCL GPU to GPU; the NCCL path is written and has a two-GPU test, not yet run in CI; vLLM
  side ``vllm_engine.py`` registered via ``WeightTransferEngineFactory.register_engine``), ``file`` (safetensors in
  shared storage + ``reload_weights``, ``files.py``).
* Each push is staged before the engine pauses (``staging.py``), so the pause holds only a tensor copy.
* The bytes of a push: ``wire.py``; membership, acks and fencing: ``members.py``.

vLLM is only imported inside the generator; the trainer needs torch and NATS only.
"""

from __future__ import annotations

from typing import Any

from weightsync.config import COLLECTIVE_TRANSPORTS, WeightSyncConfig

WORKER_EXTENSION = "weightsync.worker.WeightSyncWorkerExtension"


def vllm_args(cfg: WeightSyncConfig) -> dict[str, Any]:
    """Extra ``AsyncEngineArgs`` for a generator that follows ``cfg``'s transport."""
    args: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION}
    if cfg.resolved_transport() in COLLECTIVE_TRANSPORTS:
        args["weight_transfer_config"] = {"backend": "gloo"}
    return args


def __getattr__(name: str) -> Any:
    if name == "WeightPublisher":
        from weightsync.publisher import WeightPublisher

        return WeightPublisher
    if name == "WeightReceiver":
        from weightsync.receiver import WeightReceiver

        return WeightReceiver
    raise AttributeError(name)


__all__ = ["WORKER_EXTENSION", "WeightPublisher", "WeightReceiver", "WeightSyncConfig", "vllm_args"]
