"""TrainEngine: the frozen reference for beta > 0 (KL starts at 0 and grows), dr_grpo gets max_completion_length."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from consumers.config import TrainerConfig
from consumers.parallel import Dist


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def test_reference_model_kl(tiny_dir: Path, tmp_path: Path):
    from consumers.engine import TrainEngine
    from helpers.toybatches import ToyBatchMaker
    from models.tiny_model import load_tokenizer

    cfg = TrainerConfig(lr=1e-2, loss="dapo", loss_args={"beta": 0.1})
    eng = TrainEngine(cfg, model_dir=tiny_dir, run_dir=tmp_path, d=Dist(), max_seq_len=32)
    assert eng.ref_model is not None
    ref_before = {k: v.clone() for k, v in eng.ref_model.state_dict().items()}
    maker = ToyBatchMaker("addmod10", load_tokenizer(tiny_dir), prompts=4, group_size=4, max_tokens=2, seed=1)
    kls = [eng.step(maker.make(eng.policy.model))["kl"] for _ in range(4)]
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 1e-4
    assert all(torch.equal(v, eng.ref_model.state_dict()[k]) for k, v in ref_before.items())


def test_dr_grpo_takes_generator_max_tokens(tiny_dir: Path, tmp_path: Path):
    from consumers.engine import TrainEngine

    eng = TrainEngine(TrainerConfig(loss="dr_grpo"), model_dir=tiny_dir, run_dir=tmp_path, d=Dist(),
                      max_seq_len=32, max_completion_length=7)
    assert eng.loss_fn.max_completion_length == 7 and eng.ref_model is None
