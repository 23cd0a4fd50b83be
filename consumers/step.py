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

from consumers.losses import LossFn, sft_loss, wants_entropy_grad
from consumers.model import token_logprobs
from consumers.prefix import attention_mask, shared_prefix_layout
from topics.schemas import Batch


@dataclass(slots=True)
class StepInputs:
    """A batch as training tensors: ``mask``, ``old_logprobs`` ``[B, T]`` per episode, ``advantages`` ``[B]``.

    Padded batches: ``input_ids`` is ``[B, T]`` too. Packed batches (``topics/schemas.py``): the model runs on the
    packed rows, ``input_ids``, ``position_ids`` and ``segment_ids`` ``[R, W]``; ``per_episode`` maps what
    ``token_logprobs`` returns for those rows back to the ``[B, T]`` episode layout (``unpack_index`` holds each
    episode token's flat index into the rows, ``unpack_valid`` where an episode has a token), so every loss sees
    the same tensors whichever layout the buffer chose. ``scored`` marks the response tokens in the layout the
    model runs on: the only positions whose logprobs the loss reads. Shared-prefix rows (``trainer.shared_prefix``,
    ``consumers/prefix.py``) map back the same way and add ``attn_mask`` and ``prev``.
    """

    input_ids: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    unpack_index: torch.Tensor | None = None
    unpack_valid: torch.Tensor | None = None
    scored: torch.Tensor | None = None  # the response positions in the layout of ``input_ids`` (``token_logprobs``)
    attn_mask: torch.Tensor | None = None  # shared-prefix rows (consumers/prefix.py): the dense attention mask
    prev: torch.Tensor | None = None  # shared-prefix rows: the column predicting each token

    @property
    def tokens(self) -> int:
        return int(self.mask.sum().item())

    def per_episode(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """``[R, W]`` values of the packed rows as ``[B, T]`` per episode (zeros past each episode); identity when
        the batch is padded."""
        if rows is None or self.unpack_index is None:
            return rows
        out = rows.reshape(-1)[self.unpack_index.reshape(-1)].reshape(self.unpack_index.shape)
        return torch.where(self.unpack_valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def trim_width(batch: Batch) -> int:
    """The number of columns that hold any real token (drop all-padding tail columns)."""
    if batch.packed:  # one past the last column holding a token of any segment
        used = np.flatnonzero((batch.segment_ids >= 0).any(axis=0))
        return int(max(int(used[-1]) + 1 if used.size else 0, 2))
    if len(batch.seq_lens):
        return int(max(int(batch.seq_lens.max()), 2))
    return batch.input_ids.shape[1]


def _tensor(x: np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(x), dtype=dtype, device=device)


def batch_inputs(batch: Batch, device: torch.device | str = "cpu", *, shared_prefix_tokens: int = 0) -> StepInputs:
    """The batch as tensors: padded rows, the buffer's packed rows, or (``shared_prefix_tokens`` > 0, padded
    batches) shared-prefix rows of at most that many tokens (``consumers/prefix.py``)."""
    t = min(trim_width(batch), batch.input_ids.shape[1])
    if batch.packed:
        return _packed_inputs(batch, t, device)
    if shared_prefix_tokens > 0:
        return _prefix_inputs(batch, t, device, shared_prefix_tokens)
    mask = _tensor(batch.loss_mask[:, :t], torch.float32, device)
    return StepInputs(
        input_ids=_tensor(batch.input_ids[:, :t], torch.long, device),
        mask=mask,
        old_logprobs=_tensor(batch.old_logprobs[:, :t], torch.float32, device),
        advantages=_tensor(batch.advantages, torch.float32, device),
        scored=mask > 0,
    )


def _packed_inputs(batch: Batch, w: int, device: torch.device | str) -> StepInputs:
    seg = np.ascontiguousarray(batch.segment_ids[:, :w])
    pos = np.ascontiguousarray(batch.position_ids[:, :w])
    flat_seg = seg.ravel()
    idx = np.flatnonzero(flat_seg >= 0)
    episode, at = flat_seg[idx], pos.ravel()[idx]
    b, t = len(batch.episode_ids), max(int(batch.seq_lens.max()), 2)
    unpack = np.zeros((b, t), dtype=np.int64)
    valid = np.zeros((b, t), dtype=bool)
    unpack[episode, at] = idx
    valid[episode, at] = True
    mask = np.zeros((b, t), dtype=np.float32)
    old = np.zeros((b, t), dtype=np.float32)
    mask[episode, at] = batch.loss_mask[:, :w].ravel()[idx]
    old[episode, at] = batch.old_logprobs[:, :w].ravel()[idx]
    return StepInputs(
        input_ids=_tensor(batch.input_ids[:, :w], torch.long, device),
        mask=_tensor(mask, torch.float32, device),
        old_logprobs=_tensor(old, torch.float32, device),
        advantages=_tensor(batch.advantages, torch.float32, device),
        position_ids=_tensor(pos, torch.long, device),
        segment_ids=_tensor(seg, torch.long, device),
        unpack_index=_tensor(unpack, torch.long, device),
        unpack_valid=_tensor(valid, torch.bool, device),
        scored=_tensor(batch.loss_mask[:, :w] > 0, torch.bool, device),
    )


def _prefix_inputs(batch: Batch, t: int, device: torch.device | str, row_tokens: int) -> StepInputs:
    rows = shared_prefix_layout(batch, t, row_tokens)
    b, w = rows.unpack_index.shape
    width = min(w, t)
    mask = np.zeros((b, w), np.float32)
    old = np.zeros((b, w), np.float32)
    mask[:, :width] = batch.loss_mask[:, :width]
    old[:, :width] = batch.old_logprobs[:, :width]
    seg = _tensor(rows.segment_ids, torch.long, device)
    return StepInputs(
        input_ids=_tensor(rows.input_ids, torch.long, device),
        mask=_tensor(mask * rows.unpack_valid, torch.float32, device),
        old_logprobs=_tensor(old * rows.unpack_valid, torch.float32, device),
        advantages=_tensor(batch.advantages, torch.float32, device),
        position_ids=_tensor(rows.position_ids, torch.long, device),
        unpack_index=_tensor(rows.unpack_index, torch.long, device),
        unpack_valid=_tensor(rows.unpack_valid, torch.bool, device),
        scored=_tensor(rows.scored, torch.bool, device),
        attn_mask=attention_mask(seg),
        prev=_tensor(rows.prev, torch.long, device),
    )


def clip_grads(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (DTensor-aware); returns the norm before clipping."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    plain = not any(isinstance(p, DTensor) for p in params)  # sharded grads keep the per-tensor norm
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=plain)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm.item())


def _apply(model: nn.Module, opt: torch.optim.Optimizer, sched, loss: torch.Tensor, grad_clip: float,
           advance_schedule: bool = True) -> tuple[float, bool]:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = clip_grads(model, grad_clip)
    ok = math.isfinite(grad_norm)
    if ok:  # a non-finite gradient skips the update rather than poisoning the weights
        opt.step()
    if advance_schedule:
        sched.step()
    opt.zero_grad(set_to_none=True)
    return grad_norm, ok


def _packing(inputs: StepInputs) -> dict[str, torch.Tensor | None]:
    return {"position_ids": inputs.position_ids, "segment_ids": inputs.segment_ids, "scored": inputs.scored,
            "attn_mask": inputs.attn_mask, "prev": inputs.prev}


@torch.no_grad()
def proximal_logprobs(model: nn.Module, inputs: StepInputs, *, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` logprobs of the batch's tokens under the model's current weights, without autograd: the proximal
    policy of a decoupled loss, taken before the batch's first update. The model runs in training mode, as in
    ``rl_step``, so that before any update they equal the step's own logprobs."""
    model.train()
    return inputs.per_episode(token_logprobs(model, inputs.input_ids, temperature=temperature,
                                             **_packing(inputs))[0])


def rl_step(model: nn.Module, opt: torch.optim.Optimizer, sched, loss_fn: LossFn, inputs: StepInputs, *,
            grad_clip: float = 1.0, ref_model: nn.Module | None = None, temperature: float = 1.0,
            prox_logprobs: torch.Tensor | None = None, advance_schedule: bool = True) -> dict[str, float]:
    """One policy-gradient step on a whole batch (or a minibatch); returns the loss metrics plus grad_norm, lr,
    tokens, time. ``prox_logprobs`` go to the loss (``proximal_logprobs``); ``advance_schedule`` False keeps the
    learning rate for the batch's next optimizer step (the schedule counts batches)."""
    t0 = time.perf_counter()
    model.train()
    packing = _packing(inputs)
    grad_entropy = wants_entropy_grad(loss_fn)  # else a metric: computed without autograd
    logprobs, entropy = token_logprobs(model, inputs.input_ids, temperature=temperature, with_entropy=True,
                                       entropy_grad=grad_entropy, **packing)
    logprobs, entropy = inputs.per_episode(logprobs), inputs.per_episode(entropy)
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref = inputs.per_episode(token_logprobs(ref_model, inputs.input_ids, temperature=temperature, **packing)[0])
    extra = {"prox_logprobs": prox_logprobs} if prox_logprobs is not None else {}
    loss, metrics = loss_fn(logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask, ref,
                            entropy=entropy, **extra)
    lr = float(sched.get_last_lr()[0])
    grad_norm, ok = _apply(model, opt, sched, loss, grad_clip, advance_schedule)
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
    logprobs, _ = token_logprobs(model, input_ids, scored=mask > 0)
    loss, metrics = loss_fn(logprobs, mask)
    lr = float(sched.get_last_lr()[0])
    grad_norm, ok = _apply(model, opt, sched, loss, grad_clip)
    metrics.update(grad_norm=grad_norm, lr=lr, tokens=float(mask.sum().item()), skipped=float(not ok),
                   step_s=time.perf_counter() - t0)
    return metrics
