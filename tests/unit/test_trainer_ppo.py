"""Several optimizer steps per batch (``trainer.ppo_epochs``, ``trainer.minibatches``, ``consumers/ppo.py``) and the
proximal policy of ``decoupled_ppo``: taken before the batch's first update, it equals the current policy on the
first minibatch and differs after it, and the clip anchored there binds. The tiny model and toy batches sampled
from it; each test well under a second or two on 2 cores."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from consumers.config import TrainerConfig
from consumers.parallel import Dist
from topics.errors import ConfigError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def _engine(tiny_dir: Path, tmp_path: Path, **kw):
    from consumers.engine import TrainEngine

    return TrainEngine(TrainerConfig(**kw), model_dir=tiny_dir, run_dir=tmp_path, d=Dist(), max_seq_len=32)


def _batch(tiny_dir: Path, model, seed: int = 1):
    from helpers.toybatches import ToyBatchMaker
    from models.tiny_model import load_tokenizer

    maker = ToyBatchMaker("addmod10", load_tokenizer(tiny_dir), prompts=4, group_size=4, max_tokens=2, seed=seed)
    batch = maker.make(model)
    # an untrained model scores 0 everywhere: advantages of both signs, so that every minibatch moves the weights
    batch.advantages = np.random.default_rng(seed).standard_normal(len(batch.episode_ids)).astype(np.float32)
    return batch


def _observed(eng) -> list[tuple[torch.Tensor | None, dict[str, float]]]:
    """Record each optimizer step's proximal logprobs and metrics (the engine's own ``_update`` still runs)."""
    seen: list[tuple[torch.Tensor | None, dict[str, float]]] = []
    inner = eng._update

    def update(batch, prox=None, advance_schedule=True):
        metrics = inner(batch, prox, advance_schedule)
        seen.append((prox, metrics))
        return metrics

    eng._update = update
    return seen


def test_keys_are_validated_naming_the_key():
    for key in ("ppo_epochs", "minibatches"):
        with pytest.raises(ConfigError, match=f"trainer.{key}"):
            TrainerConfig(**{key: 0})
    with pytest.raises(ConfigError, match="trainer.ppo_epochs"):
        TrainerConfig(mode="sft", ppo_epochs=2)
    from streamforge.config import load_config

    with pytest.raises(ConfigError, match="trainer.minibatches"):  # 2 groups x 4 = 8 episodes a batch
        load_config(None, ["--buffer.groups_per_batch=2", "--generator.group_size=4", "--trainer.minibatches=9"])
    cfg = load_config(None, ["--buffer.groups_per_batch=2", "--generator.group_size=4", "--trainer.minibatches=8",
                             "--trainer.ppo_epochs=3"])
    assert (cfg.trainer.minibatches, cfg.trainer.ppo_epochs) == (8, 3)


def test_default_is_one_step_without_a_proximal_forward(tiny_dir: Path, tmp_path: Path):
    eng = _engine(tiny_dir, tmp_path, loss="decoupled_ppo", lr=1e-2)
    seen = _observed(eng)
    metrics = eng.step(_batch(tiny_dir, eng.policy.model))
    assert len(seen) == 1 and seen[0][0] is None and "updates" not in metrics
    assert metrics["prox_drift"] == 0.0 and metrics["clip_fraction"] == 0.0  # the proximal policy is the current


def test_decoupled_ppo_gets_the_weights_before_the_update(tiny_dir: Path, tmp_path: Path):
    eng = _engine(tiny_dir, tmp_path, loss="decoupled_ppo", loss_args={"epsilon": 0.1}, lr=2e-2, ppo_epochs=2,
                  minibatches=2)
    batch = _batch(tiny_dir, eng.policy.model)
    before = copy.deepcopy(eng.policy.model)
    seen = _observed(eng)
    metrics = eng.step(batch)
    assert len(seen) == 4 and metrics["updates"] == 4.0
    assert eng.sched.last_epoch == 1  # the schedule counts batches
    # the proximal logprobs of both minibatches are the initial weights', for every epoch
    from consumers.engine import split_rows
    from consumers.step import batch_inputs, proximal_logprobs

    for i, (prox, _) in enumerate(seen):
        mb = split_rows(batch, i % 2, 2)[0]
        assert torch.equal(prox, proximal_logprobs(before, batch_inputs(mb)))
    drift = [m["prox_drift"] for _, m in seen]
    clip = [m["clip_fraction"] for _, m in seen]
    assert drift[0] == pytest.approx(0.0, abs=1e-6) and clip[0] == 0.0  # first minibatch: nothing moved yet
    assert all(d > 1e-4 for d in drift[1:]), drift  # after the first update the policy left its proximal one
    assert max(clip[1:]) > 0.0, clip  # and the clip anchored there binds
    assert metrics["loss"] == pytest.approx(sum(m["loss"] for _, m in seen) / 4)
    assert metrics["tokens"] == float(batch.loss_mask.sum())  # counted once, not once per epoch


def test_a_loss_without_a_proximal_policy_gets_none(tiny_dir: Path, tmp_path: Path):
    eng = _engine(tiny_dir, tmp_path, loss="grpo", lr=1e-2, minibatches=3)
    seen = _observed(eng)
    metrics = eng.step(_batch(tiny_dir, eng.policy.model))
    assert [p for p, _ in seen] == [None, None, None] and metrics["updates"] == 3.0
    assert metrics["clip_fraction"] > 0.0 or metrics["ratio_mean"] != 1.0  # steps 2-3: ratios to old moved


def test_combine_metrics_means_sums_and_counts():
    from consumers.ppo import combine_metrics

    rows = [{"loss": 1.0, "grad_norm": 2.0, "tokens": 10.0, "step_s": 0.5, "skipped": 0.0},
            {"loss": 3.0, "grad_norm": 4.0, "tokens": 6.0, "step_s": 0.5, "skipped": 1.0, "nonfinite": 1.0},
            {"loss": 2.0, "grad_norm": 0.0, "tokens": 10.0, "step_s": 0.5, "skipped": 0.0},
            {"loss": 2.0, "grad_norm": 2.0, "tokens": 6.0, "step_s": 0.5, "skipped": 0.0}]
    out = combine_metrics(rows, per_epoch=2)
    assert out == {"loss": 2.0, "grad_norm": 2.0, "tokens": 16.0, "step_s": 2.0, "skipped": 1.0, "nonfinite": 1.0,
                   "updates": 4.0}
