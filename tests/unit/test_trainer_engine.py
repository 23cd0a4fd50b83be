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


def test_autocast_keeps_float32_master_weights_and_learns_like_float32(tiny_dir: Path, tmp_path: Path):
    """``trainer.autocast``: the step runs its matmuls in bf16, yet parameters and AdamW state stay float32, a small
    learning rate still moves them, and the step's loss and logprob drift stay close to the float32 step's."""
    from consumers.engine import TrainEngine
    from helpers.toybatches import ToyBatchMaker
    from models.tiny_model import load_tokenizer
    from topics.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.autocast"):
        TrainerConfig(autocast=True, dtype="bfloat16")
    engines = {mode: TrainEngine(TrainerConfig(lr=1e-5, loss="grpo", autocast=mode == "autocast", seed=0),
                                 model_dir=tiny_dir, run_dir=tmp_path / mode, d=Dist(), max_seq_len=32)
               for mode in ("float32", "autocast")}
    maker = ToyBatchMaker("addmod10", load_tokenizer(tiny_dir), prompts=4, group_size=4, max_tokens=2, seed=1)
    batch = maker.make(engines["float32"].policy.model)
    before = {k: v.clone() for k, v in engines["autocast"].policy.model.state_dict().items()}
    metrics = {mode: eng.step(batch) for mode, eng in engines.items()}
    params = dict(engines["autocast"].policy.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    assert all(s.dtype == torch.float32 for st in engines["autocast"].opt.state.values() for s in st.values()
               if torch.is_tensor(s) and s.is_floating_point())
    moved = sum(not torch.equal(before[k], p) for k, p in params.items())
    assert moved == len(params)  # lr 1e-5 moved every parameter (a bf16 parameter would keep most unchanged)
    assert metrics["autocast"]["loss"] == pytest.approx(metrics["float32"]["loss"], abs=0.02)
    assert metrics["autocast"]["logprob_drift"] == pytest.approx(metrics["float32"]["logprob_drift"], abs=0.05)
