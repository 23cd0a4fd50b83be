"""A hand-made two-turn Episode (model, environment, model) through the buffer's layouts and every loss: the
environment's tokens are off the loss mask, get no gradient and change no loss; the trainer's logprobs line up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from buffer.policies import build_batch, score_group
from consumers.losses import loss_names, make_loss
from consumers.model import token_logprobs
from consumers.step import batch_inputs
from topics import codec
from topics.schemas import Episode

PROMPT = [1, 20, 21, 22]
# turn 0: the model says 30 31; the environment answers 40 41 42; turn 1: the model says 32 <eos>
RESPONSE = [30, 31, 40, 41, 42, 32, 2]
MASK = [1, 1, 0, 0, 0, 1, 1]
TURNS = [0, 0, 0, 0, 0, 1, 1]
VERSIONS = [5, 5, -1, -1, -1, 6, 6]  # a weight swap between the turns
LOGPROBS = [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -0.125]


def two_turn(index: int, reward: float, *, response: list[int] = RESPONSE) -> Episode:
    return Episode(
        episode_id=f"g/{index}", group_id="g", group_size=2, prompt_id="g", task="env:test",
        prompt_tokens=np.asarray(PROMPT, dtype=np.int32), response_tokens=np.asarray(response, dtype=np.int32),
        logprobs=np.asarray(LOGPROBS, dtype=np.float32), token_versions=np.asarray(VERSIONS, dtype=np.int32),
        policy_version=5, reward=reward, token_mask=np.asarray(MASK, dtype=np.uint8),
        turn_ids=np.asarray(TURNS, dtype=np.int32), env_name="test", env_replica="r0",
        turn_rewards=np.asarray([0.0, reward], dtype=np.float32), final_reward=reward, tool_calls=1)


def batches():
    eps = [two_turn(0, 1.0), two_turn(1, 0.0, response=[33, 34, 40, 41, 42, 35, 2])]
    group = score_group("g", eps, latest_version=6, max_policy_lag=4).kept
    return eps, build_batch([group]), build_batch([group], pack_row_tokens=64)


def test_the_episode_round_trips_and_measures_its_staleness_on_model_tokens():
    ep = codec.decode(codec.encode(two_turn(0, 1.0)))
    assert ep.token_mask.tolist() == MASK and ep.turn_ids.tolist() == TURNS and ep.turns == 2
    assert ep.env_replica == "r0" and ep.turn_rewards.tolist() == [0.0, 1.0] and ep.final_reward == 1.0
    assert ep.min_version == 5  # the environment's -1 is no version


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_batch_masks_the_environment_tokens(packed: bool):
    _, padded, packed_batch = batches()
    batch = packed_batch if packed else padded
    batch.validate()
    inputs = batch_inputs(batch)
    p = len(PROMPT)
    expect = [0] * p + MASK
    assert inputs.mask[0, :p + len(MASK)].tolist() == expect
    assert inputs.old_logprobs[0, p:p + len(MASK)].tolist() == LOGPROBS
    row = batch.token_versions[0] if not packed else batch.token_versions[batch.segment_ids == 0]
    assert row[p:p + len(MASK)].tolist() == VERSIONS  # the swap between the turns shows, -1 at the environment's
    assert batch.stats["env/turns_mean"] == 2.0 and batch.stats["env/tool_calls_mean"] == 1.0
    assert batch.stats["min_version"] == 5.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def model(tiny_dir) -> torch.nn.Module:
    """The trainer's own model of the tiny policy (torchtitan, ``consumers.model.load_policy``)."""
    from consumers.model import load_policy

    return load_policy(tiny_dir, max_seq_len=32).model


def _hf_model(tiny_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", loss_names())
def test_no_loss_reads_or_trains_the_environment_tokens(name: str, model):
    """For every built-in loss: d loss / d logprobs is 0 at every position off the model's tokens (prompt,
    environment, padding) and not all 0 on them; the environment's old logprobs can be anything."""
    _, padded, packed = batches()
    loss_fn = make_loss(name)
    for batch in (padded, packed):
        inputs = batch_inputs(batch)
        packing = {"position_ids": inputs.position_ids, "segment_ids": inputs.segment_ids, "scored": inputs.scored}
        logprobs, entropy = token_logprobs(model, inputs.input_ids, with_entropy=True, **packing)
        logprobs, entropy = inputs.per_episode(logprobs), inputs.per_episode(entropy)
        extras = {"entropy": entropy, "prox_logprobs": inputs.old_logprobs}

        def loss_of(old: torch.Tensor, logprobs=logprobs, inputs=inputs, extras=extras) -> torch.Tensor:
            return loss_fn(logprobs, old, inputs.advantages, inputs.mask, logprobs.detach(), **extras)[0]

        loss = loss_of(inputs.old_logprobs)
        (grad,) = torch.autograd.grad(loss, logprobs, retain_graph=True)
        off = inputs.mask == 0
        assert grad[off].abs().max().item() == 0.0
        assert grad[~off].abs().max().item() > 0.0
        garbage = inputs.old_logprobs.clone()
        garbage[off] = -50.0  # what an environment token "had" must not matter
        assert torch.equal(loss_of(garbage).detach(), loss.detach())


def test_the_trainers_logprobs_score_each_model_token_after_the_environments(model, tiny_dir):
    """``token_logprobs`` at a model token of turn 1 is the model's logprob of it given the prompt, turn 0 and
    the environment's answer: the same from the padded and the packed layout and from a plain forward pass of the
    Hugging Face model."""
    _, padded, packed = batches()
    seq = torch.tensor([PROMPT + RESPONSE])
    with torch.no_grad():
        ref = torch.log_softmax(_hf_model(tiny_dir)(seq).logits[0, :-1], -1).gather(-1, seq[0, 1:, None])[:, 0]
        outs = []
        for batch in (padded, packed):
            inputs = batch_inputs(batch)
            lp, _ = token_logprobs(model, inputs.input_ids, position_ids=inputs.position_ids,
                                   segment_ids=inputs.segment_ids, scored=inputs.scored)
            outs.append(inputs.per_episode(lp)[0])
    p = len(PROMPT)
    at = [p + i for i, m in enumerate(MASK) if m]
    for out in outs:
        assert torch.allclose(out[at], ref[[t - 1 for t in at]], atol=1e-5)
