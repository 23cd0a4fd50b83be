"""Shared-prefix rows (``trainer.shared_prefix``) train exactly as padded rows through the real torchtitan tiny
model (fp32): the same per-token logprobs, entropies, losses and gradients (1e-5), the same ``TrainEngine`` step,
also with minibatches and a decoupled loss's proximal logprobs, and with environment tokens inside responses."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
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


def ragged_batch() -> Batch:
    """Four groups of three sharing their prompts, responses cut to different lengths, one group with environment
    tokens (mask 0) inside its responses; through the wire, as the trainer gets it."""
    groups = []
    for i, (p, r) in enumerate([(5, 11), (9, 3), (4, 20), (7, 7)]):
        eps = make_group(f"g{i}", 3, prompt_len=p, response_len=r, rewards=[0.0, 1.0, 0.5 * i], seed=i)
        for j, ep in enumerate(eps):
            n = max(1, r - 2 * j)
            ep.response_tokens, ep.logprobs, ep.token_versions = (ep.response_tokens[:n], ep.logprobs[:n],
                                                                  ep.token_versions[:n])
            if i == 2:  # an environment's answer in the middle of the response
                ep.token_mask = np.ones(n, np.uint8)
                ep.token_mask[3:6] = 0
                ep.logprobs[3:6] = 0.0
        groups.append(score_group(f"g{i}", eps, latest_version=None, max_policy_lag=9).kept)
    return codec.decode(codec.encode(build_batch(groups)), expect=Batch)


@pytest.mark.parametrize("row_tokens", [30, 1024])
def test_shared_prefix_rows_give_the_padded_logprobs_losses_and_gradients(tiny_dir: Path, row_tokens: int):
    from consumers.losses import make_loss
    from consumers.model import load_policy, token_logprobs
    from consumers.step import batch_inputs

    torch.manual_seed(0)
    model = load_policy(tiny_dir, max_seq_len=64).model
    batch = ragged_batch()
    pad_in, pre_in = batch_inputs(batch), batch_inputs(batch, shared_prefix_tokens=row_tokens)
    assert pre_in.input_ids.numel() < pad_in.input_ids.numel()
    assert (pre_in.input_ids.shape[0] == 4) == (row_tokens == 1024)  # one row a group unless the cap splits them
    lp_pad, ent_pad = token_logprobs(model, pad_in.input_ids, with_entropy=True, scored=pad_in.scored)
    lp_rows, ent_rows = token_logprobs(model, pre_in.input_ids, with_entropy=True, scored=pre_in.scored,
                                       position_ids=pre_in.position_ids, attn_mask=pre_in.attn_mask, prev=pre_in.prev)
    lp_pre, ent_pre = pre_in.per_episode(lp_rows), pre_in.per_episode(ent_rows)
    scored = pad_in.mask.bool()
    assert torch.equal(scored, pre_in.mask.bool()) and int(scored.sum()) > 0
    assert (lp_pad[scored] - lp_pre[scored]).abs().max() <= 1e-5 and lp_pad[scored].abs().min() > 0
    assert (ent_pad[scored] - ent_pre[scored]).abs().max() <= 1e-5
    assert (lp_pre[~scored] == 0).all()

    # without the prefix mask (plain causal attention over the row) a suffix would see the suffixes before it
    leaky = pre_in.per_episode(token_logprobs(model, pre_in.input_ids, scored=pre_in.scored, prev=pre_in.prev,
                                              position_ids=pre_in.position_ids,
                                              attn_mask=torch.ones_like(pre_in.attn_mask).tril())[0])
    assert (leaky[scored] - lp_pad[scored]).abs().max() > 1e-3

    for name in ("grpo", "dapo", "dr_grpo"):
        loss_fn = make_loss(name)
        grads, losses = [], []
        for inputs, lp in ((pad_in, lp_pad), (pre_in, lp_pre)):
            loss, _ = loss_fn(lp, inputs.old_logprobs, inputs.advantages, inputs.mask)
            model.zero_grad(set_to_none=True)
            loss.backward(retain_graph=True)
            losses.append(float(loss))
            grads.append([p.grad.detach().clone() for p in model.parameters()])
        assert losses[0] != 0.0 and abs(losses[0] - losses[1]) <= 1e-5, (name, losses)
        for a, b in zip(*grads, strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("loss,minibatches", [("grpo", 1), ("decoupled_ppo", 2)])
def test_train_engine_steps_alike_with_and_without_shared_prefix(tiny_dir: Path, loss: str, minibatches: int):
    from consumers.config import TrainerConfig
    from consumers.engine import TrainEngine
    from consumers.parallel import Dist

    batch = ragged_batch()
    out = []
    for shared in (False, True):
        cfg = TrainerConfig(loss=loss, lr=1e-3, export_hf=False, minibatches=minibatches, shared_prefix=shared)
        eng = TrainEngine(cfg, model_dir=tiny_dir, run_dir=tempfile.mkdtemp(), d=Dist(), max_seq_len=64)
        metrics = [eng.step(batch), eng.step(batch)]
        out.append((metrics, [p.detach().clone() for p in eng.policy.model.parameters()]))
    (m_pad, w_pad), (m_pre, w_pre) = out
    for a, b in zip(m_pad, m_pre, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4
        assert a["tokens"] == b["tokens"] and abs(a["logprob_drift"] - b["logprob_drift"]) <= 1e-5
    assert m_pad[1]["logprob_drift"] > 0  # the first step moved the weights
    # AdamW scales each parameter's update by its gradient's own running size, so a parameter whose gradient is at
    # rounding level moves by up to lr either way on rounding alone: 1.2-2e-5 apart with 1, 3 or 8 threads (3e-6
    # with 2). A tenth of one step (lr 1e-3) is still far below what a wrong gradient does (whole steps); the losses
    # and gradient norms above are compared at rounding level
    assert max(float((a - b).abs().max()) for a, b in zip(w_pad, w_pre, strict=True)) <= 1e-4


def test_one_rl_step_with_a_reference_model(tiny_dir: Path):
    """beta > 0: the frozen reference scores the shared-prefix rows too."""
    from consumers.config import TrainerConfig
    from consumers.engine import TrainEngine
    from consumers.parallel import Dist

    batch = ragged_batch()
    res = []
    for shared in (False, True):
        cfg = TrainerConfig(loss="grpo", lr=1e-3, export_hf=False, loss_args={"beta": 0.1}, shared_prefix=shared)
        eng = TrainEngine(cfg, model_dir=tiny_dir, run_dir=tempfile.mkdtemp(), d=Dist(), max_seq_len=64)
        assert eng.ref_model is not None
        eng.step(batch)
        res.append(eng.step(batch))
    assert "kl" in res[0] and res[0]["kl"] > 0
    assert abs(res[0]["kl"] - res[1]["kl"]) <= 1e-6 and abs(res[0]["loss"] - res[1]["loss"]) <= 1e-5
