"""Packed and padded batches of the same episodes train identically through the real torchtitan tiny model (fp32):
same per-token logprobs, same loss, same gradients (1e-5), and one ``rl_step`` from each moves the weights alike."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from buffer.policies import build_batch, score_group
from buffer.synthetic import make_group
from topics import codec
from topics.schemas import Batch

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def batches(pack_row_tokens: int) -> tuple[Batch, Batch]:
    shapes = [(5, 11), (9, 3), (4, 20), (7, 7)]  # sequences of 16, 12, 24 and 14 tokens
    gs = []
    for i, (p, r) in enumerate(shapes):
        eps = make_group(f"g{i}", 3, prompt_len=p, response_len=r, rewards=[0.0, 1.0, 0.5 * i], seed=i)
        gs.append(score_group(f"g{i}", eps, latest_version=None, max_policy_lag=9).kept)
    padded = build_batch(gs)
    packed = build_batch(gs, pack_row_tokens=pack_row_tokens)
    # through the wire, as the trainer gets them
    return codec.decode(codec.encode(padded), expect=Batch), codec.decode(codec.encode(packed), expect=Batch)


@pytest.mark.parametrize("row_tokens", [40, 64])
def test_packed_and_padded_give_the_same_logprobs_loss_and_gradients(tiny_dir: Path, row_tokens: int):
    from consumers.losses import make_loss
    from consumers.model import load_policy, token_logprobs
    from consumers.step import batch_inputs

    torch.manual_seed(0)
    model = load_policy(tiny_dir, max_seq_len=64).model
    padded, packed = batches(row_tokens)
    assert packed.packed and packed.input_ids.shape[0] < padded.input_ids.shape[0]
    pad_in, pack_in = batch_inputs(padded), batch_inputs(packed)
    lp_pad, ent_pad = token_logprobs(model, pad_in.input_ids, with_entropy=True)
    rows, ent_rows = token_logprobs(model, pack_in.input_ids, with_entropy=True,
                                    position_ids=pack_in.position_ids, segment_ids=pack_in.segment_ids)
    lp_pack, ent_pack = pack_in.per_episode(rows), pack_in.per_episode(ent_rows)
    valid = torch.as_tensor(pack_in.unpack_valid)
    assert valid.sum() == int(padded.seq_lens.sum())
    assert (lp_pad[valid] - lp_pack[valid]).abs().max() <= 1e-5
    assert (ent_pad[valid] - ent_pack[valid]).abs().max() <= 1e-5
    assert lp_pad[pad_in.mask.bool()].abs().min() > 0  # real logprobs at the response tokens, not zeros

    # without the block-diagonal mask and per-segment positions the packed rows would score differently
    leaky = pack_in.per_episode(token_logprobs(model, pack_in.input_ids)[0])
    assert (leaky[valid] - lp_pad[valid]).abs().max() > 1e-2

    for name in ("grpo", "dapo", "dr_grpo"):
        loss_fn = make_loss(name)
        grads = []
        losses = []
        for inputs, lp in ((pad_in, lp_pad), (pack_in, lp_pack)):
            loss, _ = loss_fn(lp, inputs.old_logprobs, inputs.advantages, inputs.mask)
            model.zero_grad(set_to_none=True)
            loss.backward(retain_graph=True)
            losses.append(float(loss))
            grads.append([p.grad.detach().clone() for p in model.parameters()])
        assert abs(losses[0] - losses[1]) <= 1e-5, (name, losses)
        assert losses[0] != 0.0
        for a, b in zip(*grads):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_logprobs_at_the_response_positions_only_equal_the_full_projection(tiny_dir: Path, layout: str):
    """``scored``: the lm_head, softmax and entropy on the response tokens only give the same values there (zeros
    elsewhere) and the same gradients as the projection of every position."""
    from consumers.model import load_policy, token_logprobs
    from consumers.step import batch_inputs

    model = load_policy(tiny_dir, max_seq_len=64).model
    padded, packed = batches(40)
    inputs = batch_inputs(padded if layout == "padded" else packed)
    packing = {"position_ids": inputs.position_ids, "segment_ids": inputs.segment_ids}
    scored = inputs.scored
    assert scored is not None and 0 < int(scored.sum()) < scored.numel()  # prompts and padding are skipped
    out = {}
    for name, kwargs in (("full", {}), ("scored", {"scored": scored})):
        lp, ent = token_logprobs(model, inputs.input_ids, with_entropy=True, **packing, **kwargs)
        model.zero_grad(set_to_none=True)
        ((inputs.per_episode(lp) * inputs.mask).sum() + (ent * scored).sum()).backward()
        out[name] = lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]
    (lp_full, ent_full, g_full), (lp_part, ent_part, g_part) = out["full"], out["scored"]
    assert (lp_part[scored] - lp_full[scored]).abs().max() <= 1e-5 and lp_full[scored].abs().min() > 0
    assert (ent_part[scored] - ent_full[scored]).abs().max() <= 1e-5
    assert (lp_part[~scored] == 0).all() and (ent_part[~scored] == 0).all()
    for a, b in zip(g_full, g_part, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_one_rl_step_from_packed_equals_one_from_padded(tiny_dir: Path):
    from consumers.losses import make_loss
    from consumers.model import load_policy
    from consumers.step import batch_inputs, rl_step

    padded, packed = batches(48)
    out = []
    base = load_policy(tiny_dir, max_seq_len=64).model
    for batch in (padded, packed):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        metrics = rl_step(model, opt, sched, make_loss("grpo"), batch_inputs(batch), grad_clip=1.0)
        out.append((metrics, [p.detach().clone() for p in model.parameters()]))
    (m_pad, w_pad), (m_pack, w_pack) = out
    assert abs(m_pad["loss"] - m_pack["loss"]) <= 1e-5 and abs(m_pad["grad_norm"] - m_pack["grad_norm"]) <= 1e-4
    assert m_pad["tokens"] == m_pack["tokens"] and abs(m_pad["logprob_drift"] - m_pack["logprob_drift"]) <= 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(w_pad, w_pack)) <= 1e-5
