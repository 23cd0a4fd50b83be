"""Multi-rank training: the ``dp x tp`` device mesh, TP and FSDP2 sharding of the policy, rank 0's broadcasts.

Design (documented choice): rank 0 alone talks to Kafka and NATS; every step it broadcasts the batch, encoded
with the wire codec (``topics.codec``, never pickle), to the other ranks. The ``world_size`` ranks form a 2-D mesh
``("dp", "tp")`` with ``tp = trainer.tp`` and ``dp = world_size / tp`` (rank ``r`` sits at ``dp = r // tp``,
``tp = r % tp``). Each data-parallel rank trains its own share of the batch's rows (``consumers.engine``
``split_rows``; the ranks of one TP group share the same rows), and the loss of a share is normalised by the
*whole* batch's counts so the gradient FSDP averages over ``dp`` is the whole-batch gradient (see
``consumers.losses``, "Data parallelism").

Sharding: ``apply_tp`` (torchtitan's Llama 3 TP plan, without sequence parallel and without loss parallel, see its
docstring) on the ``tp`` dim, then FSDP2 ``fully_shard`` on the ``dp`` dim (each block, then the root); FSDP2
shards parameters, gradients and optimizer state, which is what lets a model larger than one device train.
Ranks start through torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``); gloo on CPU, nccl on CUDA.
Gloo has no PREMUL_SUM, hence ``set_force_sum_reduction_for_comms(True)`` on every FSDP module.
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
    mesh: Any = None  # DeviceMesh ("dp", "tp"), or None for one process
    tp: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many disjoint shares a batch's rows are split into."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def dp_group(self) -> Any:
        """The process group of this rank's ``dp`` dim (None when ``dp == 1``)."""
        return self.mesh["dp"].get_group() if self.mesh is not None and self.dp > 1 else None


def init_distributed(*, tp: int = 1, timeout_s: float = 300.0) -> Dist:
    """Join the process group described by torchrun's environment (a no-op for a single process) and build the
    ``("dp", "tp")`` mesh; ``tp`` must divide the world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if tp < 1 or world % tp:
        from topics.errors import ConfigError

        raise ConfigError("trainer.tp", f"must divide the world size {world} (is {tp})")
    if world == 1:
        return Dist(rank=0, world_size=1, device=device)
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return Dist(rank=rank, world_size=world, device=device, mesh=mesh, tp=tp)


def use_tp(d: Dist, tp: int) -> Dist:
    """Rebuild ``d``'s mesh as ``(world / tp, tp)`` if its TP degree differs (in place: whoever holds ``d`` sees
    the new mesh). Collective when it rebuilds: every rank calls it with the same ``tp``."""
    if tp == d.tp:
        return d
    if tp < 1 or d.world_size % tp:
        from topics.errors import ConfigError

        raise ConfigError("trainer.tp", f"must divide the world size {d.world_size} (is {tp})")
    from torch.distributed.device_mesh import init_device_mesh

    d.mesh = init_device_mesh(d.device.type, (d.world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    d.tp = tp
    return d


def close_distributed(d: Dist, *, timeout_s: float = 120.0) -> None:
    """Leave the job's process groups once every rank is done with them, then destroy them.

    A gloo collective can return on one rank while that rank's last messages to another are still being written; a
    rank that destroys its group then (closing its sockets) fails the other's receive inside a gloo thread, which
    aborts that process ("terminate called without an active exception"; gloo issue #155, a barrier followed by
    the context's destruction). So the ranks first meet at a gloo barrier, then each marks on the job's store that
    its barrier returned (every message it waited for has arrived) and waits, up to ``timeout_s``, for every
    rank's mark: no rank closes a socket another still reads from."""
    if d.enabled and dist.is_initialized():
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        store.set(f"streamforge/closing/{d.rank}", b"1")
        store.wait([f"streamforge/closing/{r}" for r in range(d.world_size)], timedelta(seconds=timeout_s))
        dist.destroy_process_group()


def shard_policy(model: nn.Module, mesh: Any) -> nn.Module:
    """TP on the mesh's ``tp`` dim (when larger than 1, ``apply_tp``), then FSDP2 on its ``dp`` dim: each
    transformer block, then the root (embeddings, final norm, lm_head). A 1-D mesh is the ``dp`` dim alone."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        if mesh["tp"].size() > 1:
            apply_tp(model, mesh["tp"])
        mesh = mesh["dp"]
        if mesh.size() == 1:  # TP only: nothing to shard or average over dp
            return model
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    if mesh.device_type == "cpu":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def apply_tp(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Tensor parallelism on ``tp_mesh``: torchtitan's Llama 3 / Qwen 3 plan (``torchtitan/models/llama3``'s TP
    layout before its move to sharding configs), minus sequence parallel and loss parallel.

    * ``tok_embeddings``: row-wise (vocab-sharded table, replicated output: torchtitan's own vocab-parallel
      ``Embedding.forward`` on the local rows, then an all-reduce); ``lm_head``: column-wise with a
      replicated output (full logits on every TP rank: no loss parallel, so ``token_logprobs`` is unchanged);
    * per block: ``wq``/``wk``/``wv`` and ``w1``/``w3`` column-wise, ``wo``/``w2`` row-wise (one all-reduce
      after attention and one after the MLP); attention runs on the local heads (torchtitan views heads with
      ``-1``), so ``n_heads`` and ``n_kv_heads`` must be divisible by the TP degree;
    * norms hold replicated DTensor weights fed the replicated residual stream (without sequence parallel they
      compute the same thing on every TP rank); Qwen 3's q/k norms are fed head-sharded activations, so their
      weight gradient is a partial sum DTensor reduces over ``tp``. Every parameter is then a DTensor on one mesh
      (FSDP2 on ``dp`` makes them 2-D, and one ``clip_grad_norm_`` covers them all);
    * tied embeddings (``tie_word_embeddings``): torchtitan's ``init_states`` re-ties ``tok_embeddings.weight`` to
      the vocab-sharded ``lm_head.weight``, the same ``Shard(0)`` layout.

    Measured on CPU over gloo (torch 2.13): this subset runs forward, backward and AdamW; sequence parallel and
    loss parallel are not used (see the module docstring of ``tests/integration/test_parallel_ranks.py``).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for block in model.layers.values():
        attn = block.attention
        if attn.n_heads % tp or attn.n_kv_heads % tp:
            from topics.errors import ConfigError

            raise ConfigError("trainer.tp", f"{attn.n_heads} heads / {attn.n_kv_heads} KV heads are not divisible "
                              f"by tp={tp}")
    parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    _vocab_parallel_embedding(model.tok_embeddings, tp_mesh)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention.qkv_linear.wq": ColwiseParallel(),
            "attention.qkv_linear.wk": ColwiseParallel(),
            "attention.qkv_linear.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })

    def as_dtensor(placement: Any) -> Any:
        def input_fn(_mod: nn.Module, inputs: tuple, mesh: Any) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [placement], run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)
        return input_fn

    def local_out(_mod: nn.Module, out: Any, _mesh: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    for name, module in model.named_modules():
        if isinstance(getattr(module, "weight", None), torch.Tensor) and not isinstance(module.weight, DTensor):
            # q/k norms see [B, L, local heads, head_dim]: sharded on heads, so their weight gradient is a
            # partial sum that DTensor reduces over tp; every other norm sees the replicated residual stream
            heads = name.rsplit(".", 1)[-1] in ("q_norm", "k_norm")
            distribute_module(module, tp_mesh, input_fn=as_dtensor(Shard(2) if heads else Replicate()),
                              output_fn=local_out)
    return model


def _vocab_parallel_embedding(emb: nn.Module, tp_mesh: Any) -> None:
    """Shard the embedding table's rows over ``tp`` and let torchtitan's ``Embedding`` (which looks up the local
    rows when it has a ``tp_group``) run; its output is a partial sum, all-reduced to a replicated tensor.
    (torch's ``RowwiseParallel`` cannot be used: torchtitan's ``Embedding.forward`` calls ``weight.to_local()``.)"""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor

    def shard_rows(_name: str, module: nn.Module, mesh: Any) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

    def reduce_out(_mod: nn.Module, out: torch.Tensor, mesh: Any) -> torch.Tensor:
        return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    distribute_module(emb, tp_mesh, partition_fn=shard_rows, output_fn=reduce_out)
    emb.tp_group = tp_mesh.get_group()


def all_reduce_sum(d: Dist, values: list[float]) -> list[float]:
    """The sum over the ``dp`` ranks of each value (identity with one dp rank). Collective over ``dp``."""
    group = d.dp_group
    if group is None:
        return list(values)
    dev = d.device if d.device.type == "cuda" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [float(x) for x in t.tolist()]


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
