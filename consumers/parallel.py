"""Multi-rank training: process group, FSDP2 sharding of the policy, and handing batches from rank 0 to the rest.

Design (documented choice): rank 0 alone talks to Kafka and NATS; every step it broadcasts the batch, encoded
with the wire codec (``topics.codec``, never pickle), to the other ranks. Every rank runs forward/backward on the
*whole* batch, so the gradients FSDP averages are identical on every rank and a 2-rank step equals a 1-rank step
on the same batch; FSDP2 shards parameters, gradients and optimizer state, which is what lets a model larger than
one device train. Ranks start through torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``); gloo on
CPU, nccl on CUDA. Gloo has no PREMUL_SUM, hence ``set_force_sum_reduction_for_comms(True)`` on every FSDP module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(slots=True)
class Dist:
    """This process's place in the training job (world_size 1 = no process group)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(*, timeout_s: float = 300.0) -> Dist:
    """Join the process group described by torchrun's environment (a no-op for a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if world == 1:
        return Dist(rank=0, world_size=1, device=device)
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    return Dist(rank=rank, world_size=world, device=device, mesh=mesh)


def close_distributed(d: Dist) -> None:
    """Barrier then destroy (without the barrier a rank may abort while another still talks)."""
    if d.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard_policy(model: nn.Module, mesh: Any) -> nn.Module:
    """FSDP2: shard each transformer block, then the root (embeddings, final norm, lm_head)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    if mesh.device_type == "cpu":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def broadcast_bytes(d: Dist, payload: bytes | None) -> bytes:
    """Rank 0's ``payload`` on every rank (length first, then a uint8 tensor). Collective."""
    if not d.enabled:
        assert payload is not None
        return payload
    dev = d.device if d.device.type == "cuda" else torch.device("cpu")
    size = torch.tensor([len(payload) if d.is_main and payload is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if d.is_main:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev) if n else torch.empty(0, dtype=torch.uint8, device=dev)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=dev)
    if n:
        dist.broadcast(buf, src=0)
    return bytes(buf.cpu().numpy().tobytes())


def all_agree(d: Dist, flag: bool) -> bool:
    """True on every rank if ``flag`` is true on every rank (used for stop decisions)."""
    if not d.enabled:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
