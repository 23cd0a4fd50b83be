"""Checkpoint, LR schedule and ledger: resuming from a checkpoint continues exactly like never stopping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from consumers.config import TrainerConfig
from consumers.ledger import Ledger, truncate_metrics_after
from consumers.optim import lr_factor


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1)


def inputs(seed: int):
    from consumers.step import StepInputs

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 64, (4, 10), generator=g)
    mask = torch.zeros(4, 10)
    mask[:, 4:] = 1
    return StepInputs(input_ids=ids, mask=mask, old_logprobs=-torch.rand(4, 10, generator=g) * 3 * mask,
                      advantages=torch.tensor([1.0, -1.0, 0.3, -0.3]))


def fresh(tiny_dir: Path, cfg: TrainerConfig):
    from consumers.model import load_policy
    from consumers.optim import build_optimizer

    pol = load_policy(tiny_dir, max_seq_len=32)
    opt, sched = build_optimizer(pol.model, cfg)
    return pol, opt, sched


def test_resume_from_checkpoint_equals_uninterrupted(tiny_dir: Path, tmp_path: Path):
    from consumers.checkpoint import CheckpointMeta, latest_checkpoint, load_checkpoint, read_meta, save_checkpoint
    from consumers.losses import make_loss
    from consumers.parallel import Dist
    from consumers.step import rl_step

    cfg = TrainerConfig(lr=5e-3, warmup_steps=2, lr_schedule="cosine", max_steps=4)
    loss = make_loss("dapo")
    d = Dist()
    pol, opt, sched = fresh(tiny_dir, cfg)
    for s in range(3):
        rl_step(pol.model, opt, sched, loss, inputs(s))
    straight = {k: v.clone() for k, v in pol.model.state_dict().items()}

    pol, opt, sched = fresh(tiny_dir, cfg)
    for s in range(2):
        rl_step(pol.model, opt, sched, loss, inputs(s))
    meta = CheckpointMeta(step=2, policy_version=2, offsets={"x.batches:0": 2}, recent_batch_ids=["a", "b"],
                          groups=8)
    path = save_checkpoint(tmp_path, pol, opt, sched, meta, d, keep=1)
    assert path == latest_checkpoint(tmp_path) and (path / "hf" / "model.safetensors").exists()
    assert read_meta(path).offsets == {"x.batches:0": 2}
    assert read_meta(path).groups == 8  # the generators' quota counts from it after a restart
    assert json.loads((path / "meta.json").read_text())["recent_batch_ids"] == ["a", "b"]

    pol, opt, sched = fresh(tiny_dir, cfg)
    load_checkpoint(path, pol, opt, sched, d)
    assert sched.get_last_lr()[0] == pytest.approx(cfg.lr * lr_factor(cfg, 2))
    rl_step(pol.model, opt, sched, loss, inputs(2))
    resumed = pol.model.state_dict()
    for k, v in straight.items():
        assert torch.allclose(v, resumed[k], atol=1e-7), k

    # keep=1 prunes older checkpoints; a half-written (.tmp) one is never "latest"
    meta.step = 3
    save_checkpoint(tmp_path, pol, opt, sched, meta, d, keep=1, export=False)
    (tmp_path / "checkpoints" / "step-9.tmp").mkdir()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.endswith(".tmp")] == ["step-3"]
    assert latest_checkpoint(tmp_path).name == "step-3"


def test_lr_schedule_shapes():
    cfg = TrainerConfig(lr=1.0, warmup_steps=4, lr_schedule="linear", max_steps=14)
    assert [round(lr_factor(cfg, s), 3) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(cfg, 9) == pytest.approx(0.5) and lr_factor(cfg, 14) == 0.0
    cos = TrainerConfig(lr=1.0, lr_schedule="cosine", max_steps=10)
    assert lr_factor(cos, 0) == 1.0 and lr_factor(cos, 5) == pytest.approx(0.5) and lr_factor(cos, 10) == 0.0
    endless = TrainerConfig(lr=1.0, lr_schedule="cosine")
    assert lr_factor(endless, 10_000) == 1.0


def test_ledger_truncate_after_restart(tmp_path: Path):
    led = Ledger(tmp_path)
    for s in range(1, 6):
        led.record(step=s, policy_version=s - 1, batch_ids=[f"b{s}"])
    led.close()
    with open(tmp_path / "trainer" / "ledger.jsonl", "ab") as fh:
        fh.write(b'{"step": 6, "policy_')  # torn line from a crash mid-write
    assert Ledger.truncate_after(tmp_path, 3) == 2
    rows = Ledger.read(tmp_path)
    assert [r["batch_ids"] for r in rows] == [["b1"], ["b2"], ["b3"]]
    led = Ledger(tmp_path)
    led.record(step=4, policy_version=3, batch_ids=["b4"])
    led.close()
    assert [r["step"] for r in Ledger.read(tmp_path)] == [1, 2, 3, 4]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    truncate_metrics_after(metrics, 2)
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
