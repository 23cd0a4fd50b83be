"""torchtitan on CPU with the tiny model: HF parity, one training step on 1 process and on 2 ranks over gloo.

* The torchtitan model built from the tiny HF dir gives transformers' logits; its HF export reloads in
  transformers with the same logits (before and after a step).
* One GRPO step with FSDP2 over 2 gloo ranks (torchrun) yields exactly the weights of the same step on one
  process, on both ranks (each rank gathers the full weights and writes them; the test compares all three).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def make_inputs(seed: int = 0, b: int = 4, t: int = 12):
    from consumers.step import StepInputs

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 64, (b, t), generator=g)
    mask = torch.zeros(b, t)
    mask[:, 5:] = 1
    mask[1, 9:] = 0
    old = -torch.rand(b, t, generator=g) * 4 * mask
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:b]
    return StepInputs(input_ids=ids, mask=mask, old_logprobs=old, advantages=adv)


def one_step(hf_dir: Path, mesh=None) -> dict[str, torch.Tensor]:
    from consumers.config import TrainerConfig
    from consumers.losses import make_loss
    from consumers.model import hf_named_tensors, load_policy
    from consumers.optim import build_optimizer
    from consumers.step import rl_step

    torch.manual_seed(0)
    pol = load_policy(hf_dir, max_seq_len=64, mesh=mesh)
    opt, sched = build_optimizer(pol.model, TrainerConfig(lr=1e-2))
    metrics = rl_step(pol.model, opt, sched, make_loss("grpo"), make_inputs())
    assert metrics["grad_norm"] > 0 and metrics["skipped"] == 0.0
    return {k: v.clone() for k, v in hf_named_tensors(pol)}


WORKER = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import save_file
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {here!r})
    from consumers.parallel import init_distributed, close_distributed
    from test_torchtitan_cpu import one_step
    d = init_distributed(timeout_s=120)
    assert d.world_size == 2
    tensors = one_step({hf!r}, mesh=d.mesh)
    save_file({{k: v.contiguous() for k, v in tensors.items()}}, {out!r} + f"/rank{{d.rank}}.safetensors")
    close_distributed(d)
""")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def test_parity_with_transformers_and_export_roundtrip(tiny_dir: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from consumers.model import export_hf, load_policy, token_logprobs

    pol = load_policy(tiny_dir, max_seq_len=64)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    ids = make_inputs().input_ids
    with torch.no_grad():
        ours = pol.model(ids)
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    # token_logprobs follows the Batch alignment: out[:, t] scores ids[:, t] from the prefix ids[:, :t].
    lp, _ = token_logprobs(pol.model, ids)
    ref = torch.log_softmax(theirs[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert lp[:, 0].abs().max() == 0 and (lp[:, 1:] - ref).abs().max().item() < 1e-4
    out = export_hf(pol, tmp_path / "export", tiny_dir)
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert (reloaded(ids).logits - ours).abs().max().item() < 1e-4


def test_one_step_single_process_changes_weights_and_exports(tiny_dir: Path, tmp_path: Path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    before = load_file(str(tiny_dir / "model.safetensors"))
    after = one_step(tiny_dir)
    assert set(after) == set(before)
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert len(changed) == len(after)  # every tensor receives gradient with this batch
    # The stepped weights (HF names) load into transformers and agree with the torchtitan model's logits.
    from consumers.model import load_policy
    d = tmp_path / "stepped"
    d.mkdir()
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in after.items()}, str(d / "model.safetensors"))
    for name in ("config.json", "generation_config.json"):
        (d / name).write_bytes((tiny_dir / name).read_bytes())
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    pol = load_policy(d, max_seq_len=64)
    ids = make_inputs().input_ids
    with torch.no_grad():
        assert (hf(ids).logits - pol.model(ids)).abs().max().item() < 1e-4


@pytest.mark.timeout(240)
def test_two_ranks_fsdp_gloo_equal_single_process(tiny_dir: Path, tmp_path: Path):
    from safetensors.torch import load_file

    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT), here=str(Path(__file__).parent), hf=str(tiny_dir),
                                    out=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        env=env, capture_output=True, text=True, timeout=220, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0 = load_file(str(tmp_path / "rank0.safetensors"))
    rank1 = load_file(str(tmp_path / "rank1.safetensors"))
    single = one_step(tiny_dir)
    assert set(rank0) == set(rank1) == set(single)
    for k in single:
        assert torch.equal(rank0[k], rank1[k]), k
        assert torch.allclose(rank0[k], single[k], atol=1e-5, rtol=1e-4), (k, (rank0[k] - single[k]).abs().max())


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_family_parity_and_export(tmp_path: Path, tied: bool):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from consumers.model import export_hf, load_policy

    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                      rope_theta=1e6, tie_word_embeddings=tied, max_position_embeddings=128)
    hf = Qwen3ForCausalLM(cfg).float()
    hf.save_pretrained(tmp_path / "qwen3")
    pol = load_policy(tmp_path / "qwen3", max_seq_len=64)
    assert pol.family == "qwen3" and pol.config.enable_weight_tying == tied
    ids = make_inputs().input_ids
    with torch.no_grad():
        ref = hf(ids).logits
        assert (pol.model(ids) - ref).abs().max().item() < 1e-4
        out = export_hf(pol, tmp_path / "export")
        assert (AutoModelForCausalLM.from_pretrained(out)(ids).logits - ref).abs().max().item() < 1e-4
