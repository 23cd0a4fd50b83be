"""The training state of one rank (policy, optimizer, schedule, loss, reference) and the rank-0 command stream.

``TrainEngine`` is synchronous torch code with no brokers: ``step(batch)``, ``save(meta)``, ``restore()``,
``named_tensors()``, ``export()``. Every method that touches the model is *collective* when ``world_size > 1``:
all ranks must call it in the same order. Rank 0 guarantees that by announcing each call first with
``Commander.send(op, payload)``; the other ranks run ``follow(engine)``, which replays rank 0's calls until
``QUIT``. Payloads are wire-codec bytes (``topics.codec``) or JSON, never pickle.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from consumers.checkpoint import CheckpointMeta, export_final, latest_checkpoint, load_checkpoint, save_checkpoint
from consumers.config import TrainerConfig
from consumers.losses import make_loss
from consumers.model import Policy, hf_named_tensors, load_policy
from consumers.optim import build_optimizer
from consumers.parallel import Dist, broadcast_bytes
from consumers.step import batch_inputs, rl_step, sft_step
from topics import codec
from topics.schemas import Batch

log = logging.getLogger("streamforge.trainer")

STEP, PUBLISH, CHECKPOINT, EXPORT, QUIT = b"S", b"P", b"C", b"E", b"Q"


class TrainEngine:
    """One rank's model, optimizer and loss; see the module docstring for the collective rule."""

    def __init__(self, cfg: TrainerConfig, *, model_dir: str | Path, run_dir: str | Path, d: Dist,
                 max_seq_len: int = 0, temperature: float = 1.0, max_completion_length: int | None = None) -> None:
        self.cfg = cfg
        self.d = d
        self.run_dir = Path(run_dir)
        self.model_dir = Path(model_dir)
        self.temperature = temperature
        torch.manual_seed(cfg.seed)
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        self.policy: Policy = load_policy(model_dir, max_seq_len=max_seq_len, device=d.device, dtype=dtype,
                                          mesh=d.mesh)
        self.opt, self.sched = build_optimizer(self.policy.model, cfg)
        loss_args = dict(cfg.loss_args)
        if cfg.loss == "dr_grpo" and "max_completion_length" not in loss_args and max_completion_length:
            loss_args["max_completion_length"] = max_completion_length
        self.loss_fn = make_loss(cfg.loss, **loss_args)
        self.ref_model = None
        if float(loss_args.get("beta", 0.0)) > 0:
            ref = load_policy(cfg.ref_model or model_dir, max_seq_len=max_seq_len, device=d.device, dtype=dtype,
                              mesh=d.mesh)
            ref.model.eval()
            ref.model.requires_grad_(False)
            self.ref_model = ref.model

    # -- collective operations --------------------------------------------------------------------------------
    def step(self, batch: Batch) -> dict[str, float]:
        inputs = batch_inputs(batch, self.d.device)
        if self.cfg.mode == "sft":
            return sft_step(self.policy.model, self.opt, self.sched, inputs.input_ids, inputs.mask,
                            grad_clip=self.cfg.grad_clip)
        return rl_step(self.policy.model, self.opt, self.sched, self.loss_fn, inputs, grad_clip=self.cfg.grad_clip,
                       ref_model=self.ref_model, temperature=self.temperature)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Full tensors with Hugging Face names (gathered under FSDP)."""
        return [(k, v.cpu() if v.device.type != "cpu" else v) for k, v in hf_named_tensors(self.policy)]

    def save(self, meta: CheckpointMeta) -> Path | None:
        return save_checkpoint(self.run_dir, self.policy, self.opt, self.sched, meta, self.d,
                               keep=self.cfg.keep_checkpoints, export=self.cfg.export_hf)

    def restore(self) -> CheckpointMeta | None:
        """Load the newest complete checkpoint of the run, if any (every rank finds the same one on a shared fs;
        rank 0's choice is broadcast so they cannot disagree)."""
        path = latest_checkpoint(self.run_dir) if self.d.is_main else None
        name = broadcast_bytes(self.d, (str(path) if path else "").encode() if self.d.is_main else None).decode()
        if not name:
            return None
        return load_checkpoint(Path(name), self.policy, self.opt, self.sched, self.d)

    def export(self) -> Path | None:
        return export_final(self.run_dir, self.policy, self.d)


class Commander:
    """Rank 0's side: announce each collective call to the followers (a no-op with one rank)."""

    def __init__(self, d: Dist) -> None:
        self.d = d

    def send(self, op: bytes, payload: bytes = b"") -> None:
        if self.d.enabled:
            broadcast_bytes(self.d, op + payload)

    def step(self, batch: Batch) -> None:
        self.send(STEP, codec.encode(batch))

    def checkpoint(self, meta: CheckpointMeta) -> None:
        self.send(CHECKPOINT, json.dumps({"step": meta.step, "policy_version": meta.policy_version}).encode())


def follow(engine: TrainEngine) -> int:
    """A follower rank: replay rank 0's collective calls until ``QUIT``; returns the number of steps done."""
    steps = 0
    while True:
        msg = broadcast_bytes(engine.d, None)
        op, payload = msg[:1], msg[1:]
        if op == STEP:
            engine.step(codec.decode(payload, expect=Batch))
            steps += 1
        elif op == PUBLISH:
            engine.named_tensors()
        elif op == CHECKPOINT:
            info = json.loads(payload)
            engine.save(CheckpointMeta(step=info["step"], policy_version=info["policy_version"]))
        elif op == EXPORT:
            engine.export()
        elif op == QUIT:
            return steps
        else:
            raise RuntimeError(f"unknown trainer command {op!r}")


def staleness(batch: Batch, version: int) -> float:
    """Mean over response tokens of ``version - token_version`` (how many versions behind the trainer)."""
    mask = batch.loss_mask.astype(bool) & (batch.token_versions >= 0)
    if not mask.any():
        return 0.0
    return float(np.mean(version - batch.token_versions[mask]))


def model_dir_for(config: Any) -> Path:
    """``model.path``, or the tiny model built (once) into ``<run_dir>/model``."""
    if config.model.path:
        return Path(config.model.path)
    from producers.tiny_model import build_tiny_model

    out = config.run_dir / "model"
    if not (out / "config.json").exists():
        build_tiny_model(out, seed=config.run.seed)
    return out
