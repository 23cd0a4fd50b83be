"""One optimizer step: Batch -> tensors -> logprobs -> loss -> backward -> clip -> AdamW -> LR schedule.

Pure torch, no brokers: the trainer role calls these with batches it consumed, the tests call them directly.
Tensors follow the Batch conventions of ``topics/schemas.py``: ``token_logprobs`` returns ``[B, T]`` aligned with
``old_logprobs`` and ``loss_mask`` (position 0 is never a response token).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from consumers.losses import LossFn, sft_loss
from consumers.model import token_logprobs
from topics.schemas import Batch


@dataclass(slots=True)
class StepInputs:
    """A batch as training tensors (all ``[B, T]`` except ``advantages`` ``[B]``)."""

    input_ids: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.mask.sum().item())


def trim_width(batch: Batch) -> int:
    """The number of columns that hold any real token (drop all-padding tail columns)."""
    if len(batch.seq_lens):
        return int(max(int(batch.seq_lens.max()), 2))
    return batch.input_ids.shape[1]


def batch_inputs(batch: Batch, device: torch.device | str = "cpu") -> StepInputs:
    t = min(trim_width(batch), batch.input_ids.shape[1])
    return StepInputs(
        input_ids=torch.as_tensor(np.ascontiguousarray(batch.input_ids[:, :t]), dtype=torch.long, device=device),
        mask=torch.as_tensor(np.ascontiguousarray(batch.loss_mask[:, :t]), dtype=torch.float32, device=device),
        old_logprobs=torch.as_tensor(np.ascontiguousarray(batch.old_logprobs[:, :t]), dtype=torch.float32,
                                     device=device),
        advantages=torch.as_tensor(np.ascontiguousarray(batch.advantages), dtype=torch.float32, device=device),
    )


def clip_grads(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (DTensor-aware); returns the norm before clipping."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=False)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm.item())


def _apply(model: nn.Module, opt: torch.optim.Optimizer, sched, loss: torch.Tensor, grad_clip: float) -> tuple[float, bool]:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = clip_grads(model, grad_clip)
    ok = math.isfinite(grad_norm)
    if ok:  # a non-finite gradient skips the update rather than poisoning the weights
        opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return grad_norm, ok


def rl_step(model: nn.Module, opt: torch.optim.Optimizer, sched, loss_fn: LossFn, inputs: StepInputs, *,
            grad_clip: float = 1.0, ref_model: nn.Module | None = None, temperature: float = 1.0) -> dict[str, float]:
    """One policy-gradient step on a whole batch; returns the loss metrics plus grad_norm, lr, tokens, time."""
    t0 = time.perf_counter()
    model.train()
    logprobs, entropy = token_logprobs(model, inputs.input_ids, temperature=temperature, with_entropy=True)
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref, _ = token_logprobs(ref_model, inputs.input_ids, temperature=temperature)
    loss, metrics = loss_fn(logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask, ref,
                            entropy=entropy.detach())
    lr = float(sched.get_last_lr()[0])
    grad_norm, ok = _apply(model, opt, sched, loss, grad_clip)
    with torch.no_grad():
        drift = ((logprobs.detach() - inputs.old_logprobs).abs() * inputs.mask).sum() / inputs.mask.sum().clamp(min=1)
    metrics.update(grad_norm=grad_norm, lr=lr, tokens=float(inputs.tokens), skipped=float(not ok),
                   logprob_drift=float(drift), step_s=time.perf_counter() - t0)
    return metrics


def sft_step(model: nn.Module, opt: torch.optim.Optimizer, sched, input_ids: torch.Tensor, mask: torch.Tensor, *,
             grad_clip: float = 1.0, loss_fn=sft_loss) -> dict[str, float]:
    """One supervised step: mean NLL of the completion tokens (``mask``), aligned like RL batches. ``loss_fn``
    (``logprobs, mask -> loss, metrics``): a data-parallel share of it (``consumers.engine``)."""
    t0 = time.perf_counter()
    model.train()
    logprobs, _ = token_logprobs(model, input_ids)
    loss, metrics = loss_fn(logprobs, mask)
    lr = float(sched.get_last_lr()[0])
    grad_norm, ok = _apply(model, opt, sched, loss, grad_clip)
    metrics.update(grad_norm=grad_norm, lr=lr, tokens=float(mask.sum().item()), skipped=float(not ok),
                   step_s=time.perf_counter() - t0)
    return metrics
