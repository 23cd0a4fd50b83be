"""The training state of one rank (policy, optimizer, schedule, loss, reference) and the rank-0 command stream.

``TrainEngine`` is synchronous torch code with no brokers: ``step(batch)``, ``save(meta)``, ``restore()``,
``named_tensors()``, ``export()``; a step is several optimizer steps with ``trainer.ppo_epochs`` or
``trainer.minibatches`` above 1 (``consumers/ppo.py``). Every method that touches the model is *collective* when
``world_size > 1``: all ranks must call it in the same order. Rank 0 guarantees that by announcing each call first with
``Commander.send(op, payload)``; the other ranks run ``follow(engine)``, which replays rank 0's calls until
``QUIT``. Payloads are wire-codec bytes (``topics.codec``) or JSON, never pickle.

Data parallelism: every rank receives the whole batch; a ``step`` trains only this rank's ``split_rows`` share
(contiguous rows, sizes differing by at most one) with the loss normalised by the whole batch's counts
(``consumers.losses.dp_share``), so the gradient FSDP averages over the ``dp`` ranks is the whole-batch gradient,
and the step's metrics are summed (or maxed) over the ``dp`` ranks: every rank returns the global metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from consumers.checkpoint import CheckpointMeta, export_final, latest_checkpoint, load_checkpoint, save_checkpoint
from consumers.config import TrainerConfig
from consumers.losses import BatchTotals, dp_share, make_loss, sft_loss, splits_rows, wants_proximal
from consumers.model import Policy, hf_named_tensors, load_policy
from consumers.optim import build_optimizer
from consumers.parallel import Dist, all_reduce_sum, broadcast_bytes, use_tp
from consumers.ppo import ppo_update
from consumers.step import StepInputs, batch_inputs, proximal_logprobs, rl_step, sft_step
from topics import codec
from topics.schemas import Batch

log = logging.getLogger("streamforge.trainer")

STEP, PUBLISH, CHECKPOINT, EXPORT, QUIT = b"S", b"P", b"C", b"E", b"Q"


class TrainEngine:
    """One rank's model, optimizer and loss; see the module docstring for the collective rule."""

    def __init__(self, cfg: TrainerConfig, *, model_dir: str | Path, run_dir: str | Path, d: Dist,
                 max_seq_len: int = 0, temperature: float = 1.0, max_completion_length: int | None = None) -> None:
        self.cfg = cfg
        self.d = use_tp(d, cfg.tp)
        self.run_dir = Path(run_dir)
        self.model_dir = Path(model_dir)
        self.temperature = temperature
        torch.manual_seed(cfg.seed)
        dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        self.policy: Policy = load_policy(model_dir, max_seq_len=max_seq_len, device=d.device, dtype=dtype,
                                          mesh=d.mesh)
        self.opt, self.sched = build_optimizer(self.policy.model, cfg)
        loss_args = self.set_loss(cfg.loss, cfg.loss_args, max_completion_length=max_completion_length)
        self.ref_model = None
        if float(loss_args.get("beta", 0.0)) > 0:
            ref = load_policy(cfg.ref_model or model_dir, max_seq_len=max_seq_len, device=d.device, dtype=dtype,
                              mesh=d.mesh)
            ref.model.eval()
            ref.model.requires_grad_(False)
            self.ref_model = ref.model

    def set_loss(self, name: str, loss_args: dict[str, Any], *, max_completion_length: int | None = None
                 ) -> dict[str, Any]:
        """Build the loss (``make_loss``) and decide whether a step splits the batch's rows over the ``dp`` ranks
        (SFT, or a loss that declares ``totals`` or ``aggregation``); returns the loss arguments used."""
        loss_args = dict(loss_args)
        if name == "dr_grpo" and "max_completion_length" not in loss_args and max_completion_length:
            loss_args["max_completion_length"] = max_completion_length
        self.loss_fn = make_loss(name, **loss_args)
        self.split = self.d.dp > 1 and (self.cfg.mode == "sft" or splits_rows(self.loss_fn))
        if self.d.dp > 1 and not self.split and self.d.is_main:
            log.warning("loss %r declares neither `totals` nor `aggregation` (see consumers/losses.py): every one "
                        "of the %d data-parallel ranks trains the whole batch", name, self.d.dp)
        return loss_args

    # -- collective operations --------------------------------------------------------------------------------
    def step(self, batch: Batch) -> dict[str, float]:
        """The optimizer steps on ``batch``: one on the whole batch, or ``trainer.ppo_epochs x trainer.minibatches``
        (``consumers/ppo.py``); under dp each step trains this rank's share of its rows; with ``trainer.autocast``
        inside ``torch.autocast`` (bf16). Returns global metrics."""
        with torch.autocast(self.d.device.type, dtype=torch.bfloat16, enabled=self.cfg.autocast):
            if self.cfg.mode == "sft" or self.cfg.ppo_epochs * self.cfg.minibatches == 1:
                return self._update(batch)
            return ppo_update(batch, epochs=self.cfg.ppo_epochs, n_minibatches=self.cfg.minibatches,
                              split_rows=split_rows, update=self._update,
                              proximal=self._proximal if wants_proximal(self.loss_fn) else None)

    def _inputs(self, batch: Batch) -> StepInputs:
        """This rank's share of ``batch`` as tensors (the whole batch when the rows are not split), in
        shared-prefix rows with ``trainer.shared_prefix`` (mode rl)."""
        if self.split:
            batch = split_rows(batch, self.d.dp_rank, self.d.dp)[0]
        shared = self.cfg.shared_prefix_tokens if self.cfg.shared_prefix and self.cfg.mode == "rl" else 0
        return batch_inputs(batch, self.d.device, shared_prefix_tokens=shared)

    def _proximal(self, batch: Batch) -> torch.Tensor:
        """The current weights' logprobs of this rank's share of ``batch``, without autograd (collective under FSDP)."""
        return proximal_logprobs(self.policy.model, self._inputs(batch), temperature=self.temperature)

    def _update(self, batch: Batch, prox: torch.Tensor | None = None, advance_schedule: bool = True
                ) -> dict[str, float]:
        """One optimizer step on ``batch`` (this rank's share of its rows under dp); returns global metrics."""
        rl = {"prox_logprobs": prox, "advance_schedule": advance_schedule}
        if not self.split:
            inputs = self._inputs(batch)
            if self.cfg.mode == "sft":
                return sft_step(self.policy.model, self.opt, self.sched, inputs.input_ids, inputs.mask,
                                grad_clip=self.cfg.grad_clip)
            return rl_step(self.policy.model, self.opt, self.sched, self.loss_fn, inputs,
                           grad_clip=self.cfg.grad_clip, ref_model=self.ref_model, temperature=self.temperature,
                           **rl)
        totals = batch_totals(batch)
        real_rows = split_rows(batch, self.d.dp_rank, self.d.dp)[1]
        inputs = self._inputs(batch)
        if self.cfg.mode == "sft":
            def loss_fn(logprobs, mask):
                loss, metrics = sft_loss(logprobs, mask, totals=totals)
                return loss * self.d.dp, metrics

            metrics = sft_step(self.policy.model, self.opt, self.sched, inputs.input_ids, inputs.mask,
                               grad_clip=self.cfg.grad_clip, loss_fn=loss_fn)
        else:
            loss_fn = dp_share(self.loss_fn, totals, real_rows=real_rows, scale=self.d.dp)
            metrics = rl_step(self.policy.model, self.opt, self.sched, loss_fn, inputs,
                              grad_clip=self.cfg.grad_clip, ref_model=self.ref_model, temperature=self.temperature,
                              **rl)
        if "logprob_drift" in metrics:  # rl_step's masked mean over the share -> the share of the batch's mean
            metrics["logprob_drift"] *= inputs.tokens / max(1.0, totals.tokens)
        return global_metrics(self.d, metrics)

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


def batch_totals(batch: Batch) -> BatchTotals:
    """The whole batch's episodes, loss tokens and the width of its ``[B, T]`` loss tensors (``batch_inputs``)."""
    width = max(int(batch.seq_lens.max()), 2) if len(batch.seq_lens) else batch.input_ids.shape[1]
    if not batch.packed:
        width = min(width, batch.input_ids.shape[1])
    return BatchTotals(rows=len(batch.episode_ids), tokens=float(batch.loss_mask.sum()), width=width)


_TOKEN_FIELDS = ("input_ids", "loss_mask", "old_logprobs", "token_versions")
_EPISODE_FIELDS = ("advantages", "rewards", "prompt_lens", "seq_lens")


def split_rows(batch: Batch, dp_rank: int, dp: int) -> tuple[Batch, int]:
    """Data-parallel rank ``dp_rank``'s share of ``batch`` and how many episodes of it are real.

    The share is a contiguous block of the token rows (the first ``R % dp`` ranks hold one more row), so whole
    episodes: a padded row is one episode, a packed row holds whole episodes (their segment ids are renumbered
    into the share's episode list). A rank left without rows (``R < dp``) gets a copy of row 0 with an empty loss
    mask and zero advantages: it must still run forward and backward, since FSDP's gradient reduction is
    collective, and it contributes nothing."""
    r = batch.input_ids.shape[0]
    base, extra = divmod(r, dp)
    start = dp_rank * base + min(dp_rank, extra)
    rows = slice(start, start + base + (1 if dp_rank < extra else 0))
    empty = rows.stop == rows.start
    if empty:
        rows = slice(0, 1)
    tokens = {name: getattr(batch, name)[rows] for name in _TOKEN_FIELDS}
    if batch.packed:
        seg = batch.segment_ids[rows]
        episodes = np.unique(seg[seg >= 0])
        renumber = np.full(len(batch.episode_ids), -1, dtype=np.int32)
        renumber[episodes] = np.arange(len(episodes), dtype=np.int32)
        tokens["segment_ids"] = np.where(seg >= 0, renumber[np.maximum(seg, 0)], -1).astype(np.int32)
        tokens["position_ids"] = batch.position_ids[rows]
    else:
        episodes = np.arange(rows.start, rows.stop)
    share = dataclasses.replace(
        batch, episode_ids=[batch.episode_ids[i] for i in episodes], group_ids=[batch.group_ids[i] for i in episodes],
        **tokens, **{name: getattr(batch, name)[episodes] for name in _EPISODE_FIELDS})
    if empty:
        share.loss_mask = np.zeros_like(share.loss_mask)
        share.advantages = np.zeros_like(share.advantages)
        return share, 0
    return share, len(episodes)


_MAX_METRICS = ("skipped", "step_s")  # the worst rank's value
_SAME_METRICS = ("grad_norm", "lr")  # already global (the norm is computed over the sharded gradient)


def global_metrics(d: Dist, metrics: dict[str, float]) -> dict[str, float]:
    """Sum the shares of a step's metrics over the ``dp`` ranks (``_MAX_METRICS`` take the max, ``_SAME_METRICS``
    are kept), add ``nonfinite`` if the summed loss is not finite. Collective over ``dp``; every rank must report
    the same metric names (checked)."""
    names = sorted(metrics)
    summed = [k for k in names if k not in _MAX_METRICS and k not in _SAME_METRICS]
    maxed = [k for k in names if k in _MAX_METRICS]
    crc = float(zlib.crc32(",".join(names).encode()))
    out = dict(metrics)
    if d.dp_group is not None:
        import torch.distributed as dist

        dev = d.device if d.device.type == "cuda" else torch.device("cpu")
        t = torch.tensor([metrics[k] for k in maxed] + [crc, -crc], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.dp_group)
        if t[-2].item() != crc or t[-1].item() != -crc:
            raise RuntimeError(f"data-parallel ranks report different metric names (this rank: {names})")
        out.update(zip(maxed, t[:-2].tolist()))
        out.update(zip(summed, all_reduce_sum(d, [metrics[k] for k in summed])))
    if "loss" in out and not math.isfinite(out["loss"]):
        out["nonfinite"] = 1.0
    return out


def max_staleness(batch: Batch, version: int) -> int:
    """The largest ``version - token_version`` over the batch's response tokens (0 with none)."""
    mask = batch.loss_mask.astype(bool) & (batch.token_versions >= 0)
    if not mask.any():
        return 0
    return int(version - batch.token_versions[mask].min())


def staleness(batch: Batch, version: int) -> float:
    """Mean over response tokens of ``version - token_version`` (how many versions behind the trainer)."""
    mask = batch.loss_mask.astype(bool) & (batch.token_versions >= 0)
    if not mask.any():
        return 0.0
    return float(np.mean(version - batch.token_versions[mask]))
