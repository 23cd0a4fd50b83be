"""Decoupled PPO learns under a forced lag of 4 versions: every batch sampled by weights exactly 4 versions behind
the trainer (``tests/helpers/lagged.py``), the demo's task, warm start and target (running mean reward 0.8 over 20
batches), 4 minibatch steps per batch (``trainer.minibatches``), the trainer's own ``TrainEngine``.

Bounded, not timed: at most 400 batches (measured: the target at batch 222, ~25 s on 2 quiet cores). The comparison
with the naive ``grpo`` objective under the same lag is ``bench/lag.py`` (``bench/RESULTS.md``): one seed of it
is too noisy for a test.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.mark.timeout(280)
def test_decoupled_ppo_reaches_the_demo_target_four_versions_behind(tmp_path, one_thread):
    from helpers.lagged import run_lagged
    from models.tiny_model import build_tiny_model
    from models.warmstart import warm_start

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    warm_start(model_dir, "addmod10", target_accuracy=0.3, seed=0)  # the demo's (model.warmstart_accuracy)
    run = run_lagged(model_dir, tmp_path / "run", loss="decoupled_ppo", lag=4, minibatches=4, target=0.8,
                     max_steps=400, seed=0)
    assert run.reached, (run.steps, run.curve[::25])
    assert run.curve[-1] >= 0.8 and run.curve[19] < 0.5  # it learned: it started from the warm start's ~0.2
    # the clip anchored at the proximal policy bound in the steps after each batch's first
    assert np.mean(run.clip_fraction) > 0.0
