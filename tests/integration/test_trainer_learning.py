"""A short, bounded learning check: the trainer's engine, fed by an in-process toy-task batch maker that samples
from the policy itself (``tests/helpers/toybatches.py``), raises the mean reward of ``addmod10``.

Not timed: a fixed number of steps (100; 0.1-0.3 s each on 2 cores). Measured here with lr 3e-3: the mean reward
over 20 steps goes from ~0.007 (a random character) to ~0.08 by step 100 (the policy learns to answer with one
digit and stop; the sum itself takes hundreds of steps more, as in FACTS.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.mark.timeout(280)
def test_mean_reward_rises_on_addmod10(tmp_path, one_thread):
    from consumers.config import TrainerConfig
    from consumers.engine import TrainEngine
    from consumers.parallel import Dist
    from helpers.toybatches import ToyBatchMaker
    from models.tiny_model import build_tiny_model, load_tokenizer

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    torch.manual_seed(0)
    engine = TrainEngine(TrainerConfig(lr=3e-3, loss="grpo"), model_dir=model_dir, run_dir=tmp_path / "run",
                         d=Dist(), max_seq_len=64)
    maker = ToyBatchMaker("addmod10", load_tokenizer(model_dir), prompts=8, group_size=8, max_tokens=2, seed=0)
    rewards, losses = [], []
    for step in range(100):
        batch = maker.make(engine.policy.model, version=step)
        assert batch.loss_mask.sum() > 0 and np.isfinite(batch.old_logprobs).all()
        metrics = engine.step(batch)
        rewards.append(float(batch.rewards.mean()))
        losses.append(metrics["loss"])
    first, last = np.mean(rewards[:20]), np.mean(rewards[-20:])
    assert np.isfinite(losses).all()
    assert last >= first + 0.04 and last >= 0.05, (first, last, rewards)
