"""Batch layout seen by the trainer: behaviour logprobs line up with ``token_logprobs``; SFT masks completions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from consumers.engine import staleness
from topics import codec
from topics.schemas import Batch, SFTExample


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=2)


def test_sampled_logprobs_align_with_trainer_logprobs(tiny_dir: Path):
    """The sampler's per-token logprobs (what a generator sends) equal the trainer's recomputation at the masked
    positions: the Batch alignment convention of topics/schemas.py holds end to end."""
    from consumers.model import load_policy, token_logprobs
    from consumers.step import batch_inputs
    from helpers.toybatches import ToyBatchMaker
    from models.tiny_model import load_tokenizer

    pol = load_policy(tiny_dir, max_seq_len=32)
    maker = ToyBatchMaker("reverse", load_tokenizer(tiny_dir), prompts=3, group_size=4, max_tokens=4, seed=5)
    batch = codec.decode(codec.encode(maker.make(pol.model, version=7)), expect=Batch)  # through the wire codec
    inputs = batch_inputs(batch)
    with torch.no_grad():
        lp, _ = token_logprobs(pol.model, inputs.input_ids)
    m = inputs.mask.bool()
    assert m.sum() > 0 and not m[:, 0].any()
    assert torch.allclose(lp[m], inputs.old_logprobs[m], atol=1e-4)
    assert (inputs.old_logprobs[~m] == 0).all()
    # GRPO advantages are zero-mean within each group; versions are stamped on response tokens only
    for g in set(batch.group_ids):
        idx = [i for i, x in enumerate(batch.group_ids) if x == g]
        assert abs(float(batch.advantages[idx].sum())) < 1e-4
    assert set(np.unique(batch.token_versions[batch.loss_mask == 1])) == {7}
    assert staleness(batch, 9) == 2.0


def test_sft_collate_masks_completion_and_eos(tiny_dir: Path):
    from consumers.sft import collate_sft
    from models.tiny_model import EOS_ID, load_tokenizer

    tok = load_tokenizer(tiny_dir)
    batch = collate_sft(tok, [SFTExample(example_id="a", prompt="2+3=", completion="5"),
                              SFTExample(example_id="b", prompt="reverse abc:", completion="cba")], max_seq_len=64)
    batch.validate()
    row = batch.input_ids[1]
    n = int(batch.seq_lens[1])
    assert tok.decode(row[batch.loss_mask[1] == 1][:-1]) == "cba" and row[n - 1] == EOS_ID
    assert batch.loss_mask[0].sum() == 2 and batch.loss_mask[1].sum() == 4  # completion + <eos>
    assert (batch.input_ids[0, int(batch.seq_lens[0]):] == tok.pad_token_id).all()
    same = collate_sft(tok, [SFTExample(example_id="b", prompt="x", completion="y"),
                             SFTExample(example_id="a", prompt="x", completion="y")], max_seq_len=64)
    assert same.batch_id == batch.batch_id  # the id depends on the example ids only, not their order
    short = collate_sft(tok, [SFTExample(example_id="c", prompt="reverse abc:", completion="cba")], max_seq_len=8)
    assert short.input_ids.shape[1] == 8 and short.loss_mask.sum() == 0  # truncated inside the prompt


def test_entropy_carries_a_gradient_only_for_a_loss_that_uses_it(tiny_dir: Path):
    """``entropy_coef`` moves the weights (the entropy reaches the loss with its gradient); without it the entropy
    is a metric, computed without autograd, and the step is the same as before."""
    import copy

    from consumers.losses import make_loss, wants_entropy_grad
    from consumers.model import load_policy, token_logprobs
    from consumers.step import batch_inputs, rl_step
    from helpers.toybatches import ToyBatchMaker
    from models.tiny_model import load_tokenizer

    pol = load_policy(tiny_dir, max_seq_len=32)
    maker = ToyBatchMaker("reverse", load_tokenizer(tiny_dir), prompts=3, group_size=4, max_tokens=4, seed=5)
    inputs = batch_inputs(maker.make(pol.model, version=0))
    _, ent = token_logprobs(pol.model, inputs.input_ids, with_entropy=True, entropy_grad=False)
    assert ent is not None and not ent.requires_grad and ent[inputs.mask.bool()].min() > 0
    weights = {}
    for coef in (0.0, 0.5):
        loss_fn = make_loss("grpo", entropy_coef=coef)
        assert wants_entropy_grad(loss_fn) == (coef > 0)
        model = copy.deepcopy(pol.model)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        metrics = rl_step(model, opt, sched, loss_fn, inputs, grad_clip=1e9)
        assert metrics["entropy"] > 0
        weights[coef] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert (weights[0.5] - weights[0.0]).abs().max() > 1e-6


def test_entropy_metric_in_chunks_equals_the_whole_expression(monkeypatch: pytest.MonkeyPatch):
    """The metric's chunks (a few rows at a time, so no ``[N, V]`` product is allocated) add up to the one-expression
    entropy the loss differentiates, whatever the chunk size against the rows."""
    import consumers.model as m

    logp = torch.log_softmax(torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    whole = m.entropy_of(logp.clone().requires_grad_(True), grad=True)
    assert whole.requires_grad and whole.shape == (3, 7)
    for chunk in (1, 50, 120, 1 << 19):  # under one row, one row, 2.4 rows, everything
        monkeypatch.setitem(m.ENTROPY_CHUNK_ELEMENTS, "cpu", chunk)
        part = m.entropy_of(logp, grad=False)
        assert not part.requires_grad and torch.allclose(part, whole.detach(), atol=1e-6)
