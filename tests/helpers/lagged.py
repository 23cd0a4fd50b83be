"""Training under a forced lag: every batch sampled by weights exactly ``lag`` versions behind the trainer.

The test/bench knob for staleness that the running system only bounds (``streamforge/staleness.py``): here the
trainer publishes a version after every batch (``publish_every`` 1) and the batch it trains at version ``v`` was
sampled by version ``max(0, v - lag)`` (the stored weights of that version, on a second copy of the model), so every
batch after the first ``lag`` is exactly ``lag`` versions stale (``token_versions``). Batches come from
``ToyBatchMaker`` (the toy task's prompts, GRPO advantages, groups whose rewards all agree left out as the demo's
buffer does); the trainer is ``TrainEngine``, the trainer role's own
step. ``run_lagged`` stops when the running mean reward over ``window`` batches (every rollout's reward, as the
demo's ``reward_mean``) reaches ``target``, or after ``max_steps`` batches.
"""

from __future__ import annotations

import collections
import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


@dataclass(slots=True)
class LaggedRun:
    loss: str
    steps: int  # batches trained
    reached: bool  # the running mean reached the target
    curve: list[float] = field(default_factory=list)  # the running mean reward after each batch
    rewards: list[float] = field(default_factory=list)  # each batch's mean reward
    clip_fraction: list[float] = field(default_factory=list)  # each batch's mean over its optimizer steps
    prox_drift: list[float] = field(default_factory=list)  # decoupled_ppo's mean |log pi - log pi_prox|, same
    train_s: float = 0.0
    wall_s: float = 0.0


def run_lagged(model_dir: Path, run_dir: Path, *, loss: str, lag: int = 4, target: float = 0.8, window: int = 20,
               max_steps: int = 400, lr: float = 3e-4, minibatches: int = 1, ppo_epochs: int = 1,
               loss_args: dict | None = None, prompts: int = 8, group_size: int = 8, seed: int = 0,
               task: str = "addmod10", filter_zero_variance: bool = True) -> LaggedRun:
    from consumers.config import TrainerConfig
    from consumers.engine import TrainEngine
    from consumers.parallel import Dist
    from helpers.toybatches import ToyBatchMaker
    from models.tiny_model import load_tokenizer

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    cfg = TrainerConfig(lr=lr, loss=loss, loss_args=dict(loss_args or {}), minibatches=minibatches,
                        ppo_epochs=ppo_epochs, seed=seed)
    engine = TrainEngine(cfg, model_dir=model_dir, run_dir=run_dir, d=Dist(), max_seq_len=64)
    sampler = copy.deepcopy(engine.policy.model)
    maker = ToyBatchMaker(task, load_tokenizer(model_dir), prompts=prompts, group_size=group_size, max_tokens=2,
                          seed=seed)
    versions: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=lag + 1)
    run = LaggedRun(loss=loss, steps=0, reached=False)
    recent: collections.deque[float] = collections.deque(maxlen=window)
    train_s = 0.0
    for version in range(max_steps):
        versions.append({k: v.detach().clone() for k, v in engine.policy.model.state_dict().items()})
        sampler.load_state_dict(versions[0])  # version max(0, version - lag)
        batch = maker.make(sampler, version=max(0, version - lag), filter_zero_variance=filter_zero_variance)
        t = time.perf_counter()
        metrics = engine.step(batch)
        train_s += time.perf_counter() - t
        run.steps = version + 1
        recent.append(float(np.mean(maker.rollout_rewards)))
        run.rewards.append(recent[-1])
        run.curve.append(float(np.mean(recent)))
        run.clip_fraction.append(float(metrics.get("clip_fraction", 0.0)))
        run.prox_drift.append(float(metrics.get("prox_drift", 0.0)))
        if len(recent) == window and run.curve[-1] >= target:
            run.reached = True
            break
    run.train_s, run.wall_s = train_s, time.perf_counter() - t0
    return run
