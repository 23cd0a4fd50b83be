"""Data and tensor parallelism with real gloo process groups (torchrun), against one process on the whole batch.

* dp2 (2 ranks, ``trainer.tp = 1``): each rank trains its share of an uneven 5-row batch (3 + 2 rows), and of a
  packed batch (7 episodes in 5 rows: 3 rows holding 5 episodes, 2 rows holding 2); the gradient
  after FSDP's reduction equals the 1-process gradient for every built-in loss (sequence-mean grpo/gspo/sapo,
  token-level bnpo/dapo/cispo/reinforce/decoupled_ppo, constant dr_grpo, with KL, entropy bonus and masks), for a
  user loss that declares ``aggregation``, for a user loss that declares nothing (each rank then trains the whole
  batch) and for SFT; a 1-row batch (one rank holds a masked-out padding row) too; and in shared-prefix rows
  (``trainer.shared_prefix``: two groups of 3 sharing their prompts, each rank laying out the rows it got). The
  reported metrics (loss, tokens, kl, entropy, clip fraction, grad norm...) are the global ones.
* tp2 (2 ranks, ``trainer.tp = 2``): logprobs and gradients equal the 1-process ones; one AdamW step gives the
  1-process weights, gathered to full HF tensors (``named_tensors`` and the HF export); a checkpoint written under
  TP resumes (weights, optimizer state: the next step equals the uninterrupted run's). Also the gradient of a tied
  Qwen 3 (q/k norms on sharded heads, one vocab-sharded tied embedding).
* dp2 x tp2 (4 ranks): the gradient and one step of grpo on the uneven batch equal the 1-process ones, and grpo's
  gradient in shared-prefix rows.

Measured on CPU over gloo (torch 2.13, torchtitan 0.3): the TP subset in ``consumers/parallel.apply_tp`` (no
sequence parallel, no loss parallel) runs; the logits are replicated on every TP rank.

Tolerances: fp32, the same math summed in another order (rows split over ranks, partial sums all-reduced, TP
matmuls split over the hidden dimension). Gradients are compared with ``atol = 1e-5 * max|ref|`` (about 100 fp32
ulps of the largest entry; measured: at most 7.6e-7 of it over every case, dp2, tp2 and dp2 x tp2) and metrics
with ``rel 1e-5``: a factor or normaliser error (a rank-local mean, a missing dp factor) is off by 10 % or more.
Weights after AdamW steps: ``assert_same_weights`` (``5e-4`` at lr ``1e-2``; measured 1.6e-4 after one tp2 step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from consumers.losses import register_loss
from topics.schemas import Batch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def user_token_loss():
    """A user loss with the plain public signature that declares its aggregation (token mean)."""
    def fn(logprobs, old_logprobs, advantages, mask, ref_logprobs=None):
        ratio = torch.exp(logprobs - old_logprobs)
        loss = -(ratio * advantages[:, None] * mask).sum() / mask.sum().clamp(min=1.0)
        return loss, {"loss": float(loss), "ratio": float((ratio * mask).sum() / mask.sum().clamp(min=1.0))}

    fn.aggregation = "token"
    return fn


def user_plain_loss():
    """A user loss that declares nothing: each dp rank trains the whole batch."""
    def fn(logprobs, old_logprobs, advantages, mask, ref_logprobs=None):
        loss = -((logprobs * mask).sum(-1) / mask.sum(-1).clamp(min=1.0) * advantages).mean()
        return loss, {"loss": float(loss)}

    return fn


register_loss("test_user_token", user_token_loss)
register_loss("test_user_plain", user_plain_loss)

# (case name, mode, loss, loss_args, batch)
CASES = [
    ("grpo", "rl", "grpo", {}, "uneven"),
    ("grpo_1row", "rl", "grpo", {}, "one"),
    ("grpo_packed", "rl", "grpo", {}, "packed"),
    ("dapo_packed", "rl", "dapo", {"beta": 0.04}, "packed"),
    ("bnpo", "rl", "bnpo", {}, "uneven"),
    ("dapo_kl_entropy", "rl", "dapo", {"beta": 0.04, "entropy_coef": 0.01}, "uneven"),
    ("dr_grpo", "rl", "dr_grpo", {}, "uneven"),
    ("gspo", "rl", "gspo", {"epsilon": 0.02, "epsilon_high": 0.03}, "uneven"),
    ("cispo", "rl", "cispo", {"epsilon_high": 1.05}, "uneven"),
    ("sapo", "rl", "sapo", {}, "uneven"),
    ("reinforce", "rl", "reinforce", {"is_cap": 1.1}, "uneven"),
    ("decoupled_masks", "rl", "decoupled_ppo", {"off_policy_mask_threshold": 0.05, "ratio_mask_threshold": 1.5},
     "uneven"),
    ("user_token", "rl", "test_user_token", {}, "uneven"),
    ("user_plain", "rl", "test_user_plain", {}, "uneven"),
    ("sft", "sft", "grpo", {}, "uneven"),
    # trainer.shared_prefix: groups of 3 sharing their prompt, each rank laying out the rows it got
    ("grpo_shared_prefix", "rl_shared", "grpo", {}, "shared"),
    ("dapo_kl_shared_prefix", "rl_shared", "dapo", {"beta": 0.04, "entropy_coef": 0.01}, "shared"),
]
QWEN_CASES = [("grpo", "rl", "grpo", {}, "uneven")]
COMPARED = ("loss", "policy_loss", "tokens", "kl", "entropy", "clip_fraction", "ratio_mean", "grad_norm", "nll",
            "off_policy_masked", "ratio_masked", "behav_weight_mean", "ratio", "logprob_drift")


def make_batch(hf_dir: Path, rows: int, seed: int = 0, group: int = 0) -> Batch:
    """Rows of different prompt and response lengths (right-padded); old logprobs near the current policy's, so
    some tokens are clipped and some are not. ``group`` > 0: each block of that many rows is a group sharing its
    first row's prompt."""
    from consumers.model import load_policy, token_logprobs

    rng = np.random.default_rng(seed)
    t = 14
    ids = rng.integers(4, 64, size=(rows, t)).astype(np.int32)
    prompt = rng.integers(2, 5, size=rows).astype(np.int32)
    seq = np.minimum(t, prompt + rng.integers(3, 10, size=rows)).astype(np.int32)
    if group:
        for first in range(0, rows, group):
            ids[first:first + group, :prompt[first]] = ids[first, :prompt[first]]
            prompt[first:first + group] = prompt[first]
        seq = np.minimum(t, prompt + rng.integers(3, 10, size=rows)).astype(np.int32)
    seq[0] = t - 1  # the widest row (the batch's trimmed width) is on rank 0; rank 1's rows are narrower
    mask = np.zeros((rows, t), dtype=np.uint8)
    for i in range(rows):
        mask[i, prompt[i]:seq[i]] = 1
        ids[i, seq[i]:] = 0
    pol = load_policy(hf_dir, max_seq_len=64)
    with torch.no_grad():
        cur, _ = token_logprobs(pol.model, torch.as_tensor(ids, dtype=torch.long))
    old = np.where(mask == 1, cur.numpy() + rng.normal(0, 0.15, size=(rows, t)), 0).astype(np.float32)
    adv = rng.normal(0, 1, size=rows).astype(np.float32)
    groups = [f"g{i // group}" for i in range(rows)] if group else ["g"] * rows
    return Batch(batch_id=f"b{rows}", episode_ids=[f"g/{i}" for i in range(rows)], group_ids=groups,
                 input_ids=ids, loss_mask=mask, old_logprobs=old, token_versions=np.where(mask == 1, 0, -1).astype(np.int32),
                 advantages=adv, rewards=adv, prompt_lens=prompt, seq_lens=seq)


def pack_batch(batch: Batch, row_tokens: int) -> Batch:
    """The same episodes packed (``topics/schemas.py``): in order, each into the current row if it fits."""
    placed: list[list[int]] = [[]]
    for e, n in enumerate(batch.seq_lens):
        if sum(batch.seq_lens[i] for i in placed[-1]) + n > row_tokens:
            placed.append([])
        placed[-1].append(e)
    shape = (len(placed), row_tokens)
    out = {"input_ids": np.zeros(shape, np.int32), "loss_mask": np.zeros(shape, np.uint8),
           "old_logprobs": np.zeros(shape, np.float32), "token_versions": np.full(shape, -1, np.int32),
           "segment_ids": np.full(shape, -1, np.int32), "position_ids": np.zeros(shape, np.int32)}
    for r, episodes in enumerate(placed):
        at = 0
        for e in episodes:
            n = int(batch.seq_lens[e])
            for name in ("input_ids", "loss_mask", "old_logprobs", "token_versions"):
                out[name][r, at:at + n] = getattr(batch, name)[e, :n]
            out["segment_ids"][r, at:at + n] = e
            out["position_ids"][r, at:at + n] = np.arange(n)
            at += n
    packed = dataclasses.replace(batch, batch_id=batch.batch_id + "-packed", **out)
    packed.validate()
    return packed


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor (collective under FSDP/TP)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in engine.policy.model.named_parameters()}


def grads_of_step(engine, batch: Batch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Run ``engine.step`` with the optimizer update replaced by recording the (reduced) gradients: the weights
    do not move, so the cases can share one engine."""
    seen: list[dict[str, torch.Tensor]] = []
    real_step = engine.opt.step
    engine.opt.step = lambda *a, **k: seen.append(full_grads(engine))
    try:
        metrics = engine.step(batch)
    finally:
        engine.opt.step = real_step
    assert len(seen) == 1
    return seen[0], metrics


def engine_for(hf_dir: Path, run_dir: Path, d, *, mode: str, tp: int, world: int, lr: float = 1e-2):
    from consumers.config import TrainerConfig
    from consumers.engine import TrainEngine

    shared = mode == "rl_shared"  # mode rl in shared-prefix rows
    cfg = TrainerConfig(mode="rl" if shared else mode, lr=lr, world_size=world, tp=tp, loss="dapo", grad_clip=0.0,
                        loss_args={"beta": 0.04, "entropy_coef": 0.01}, checkpoint_every=1, shared_prefix=shared)
    return TrainEngine(cfg, model_dir=hf_dir, run_dir=run_dir, d=d, max_seq_len=64)


def run_grad_cases(hf_dir: Path, run_dir: Path, d, batches: dict[str, Batch], *, tp: int, world: int,
                   cases=CASES) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, float]]]:
    engines: dict[str, object] = {}
    out = {}
    for name, mode, loss, args, which in cases:
        if mode not in engines:
            engines[mode] = engine_for(hf_dir, run_dir, d, mode=mode, tp=tp, world=world)
        eng = engines[mode]
        eng.set_loss(loss, args)
        out[name] = grads_of_step(eng, batches[which])
    return out


def run_tp_steps(hf_dir: Path, run_dir: Path, d, batch: Batch, *, tp: int, world: int) -> dict[str, object]:
    """logprobs; one AdamW step -> full HF tensors and the HF export; checkpoint; a resumed engine's next step
    against the uninterrupted engine's next step."""
    from consumers.checkpoint import CheckpointMeta
    from consumers.model import token_logprobs

    eng = engine_for(hf_dir, run_dir, d, mode="rl", tp=tp, world=world)
    eng.set_loss("grpo", {})
    with torch.no_grad():
        lp, _ = token_logprobs(eng.policy.model, torch.as_tensor(batch.input_ids, dtype=torch.long))
    grads, _ = grads_of_step(eng, batch)
    metrics = eng.step(batch)
    step1 = {k: v.clone() for k, v in eng.named_tensors()}
    eng.save(CheckpointMeta(step=1, policy_version=1))
    export = eng.export()
    eng.step(batch)
    step2 = dict(eng.named_tensors())
    resumed = engine_for(hf_dir, run_dir, d, mode="rl", tp=tp, world=world)
    resumed.set_loss("grpo", {})
    meta = resumed.restore()
    restored = {k: v.clone() for k, v in resumed.named_tensors()}  # (replicated weights come back as views)
    resumed.step(batch)
    resumed2 = dict(resumed.named_tensors())
    return {"logprobs": lp, "grads": grads, "metrics": metrics, "step1": step1, "export": export, "step2": step2,
            "restored_step": meta.step if meta else None, "restored": restored, "resumed2": resumed2}


WORKER = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from safetensors.torch import save_file
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {here!r})
    from consumers.parallel import init_distributed, close_distributed
    from topics import codec
    from topics.schemas import Batch
    import test_parallel_ranks as T
    out, hf, world, scenario, qwen = Path({out!r}), Path({hf!r}), {world!r}, {scenario!r}, {qwen!r}
    d = init_distributed(timeout_s=180)
    assert d.world_size == world
    batches = {{k: codec.decode((out / f"{{k}}.batch").read_bytes(), expect=Batch) for k in ("uneven", "one", "packed", "shared")}}
    def save(name, tensors):
        if d.rank == 0:
            save_file({{k: v.contiguous() for k, v in tensors.items()}}, str(out / f"{{name}}.safetensors"))
    if scenario in ("dp", "dptp"):
        cases = T.CASES if scenario == "dp" else [c for c in T.CASES if c[0] in ("grpo", "dapo_kl_entropy", "grpo_shared_prefix")]
        res = T.run_grad_cases(hf, out / "run_grads", d, batches, tp=1 if scenario == "dp" else 2, world=world,
                               cases=cases)
        for name, (grads, metrics) in res.items():
            save("grads_" + name, grads)
        if d.rank == 0:
            (out / "metrics.json").write_text(json.dumps({{k: m for k, (g, m) in res.items()}}))
    if scenario in ("tp", "dptp"):
        res = T.run_tp_steps(hf, out / "run_tp", d, batches["uneven"], tp=2, world=world)
        save("logprobs", {{"lp": res["logprobs"]}})
        if qwen:
            grads, _ = T.run_grad_cases(Path(qwen), out / "run_qwen", d, batches, tp=2, world=world,
                                        cases=T.QWEN_CASES)["grpo"]
            save("qwen_grads", grads)
        for key in ("grads", "step1", "step2", "restored", "resumed2"):
            save(key, res[key])
        if d.rank == 0:
            (out / "tp.json").write_text(json.dumps({{"metrics": res["metrics"], "export": str(res["export"]),
                                                       "restored_step": res["restored_step"]}}))
    close_distributed(d)
""")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def batches(tiny_dir: Path) -> dict[str, Batch]:
    uneven = make_batch(tiny_dir, 5)
    packed = pack_batch(make_batch(tiny_dir, 7, seed=2), 20)
    assert packed.input_ids.shape == (5, 20) and len(packed.episode_ids) == 7  # rows of 2, 1, 2, 1, 1 episodes
    shared = make_batch(tiny_dir, 6, seed=3, group=3)
    assert len(set(shared.group_ids)) == 2 and len(set(shared.prompt_lens[:3])) == 1
    return {"uneven": uneven, "one": make_batch(tiny_dir, 1, seed=1), "packed": packed, "shared": shared}


def launch(tiny_dir: Path, out: Path, batches: dict[str, Batch], *, world: int, scenario: str,
           qwen: Path | None = None) -> None:
    from topics import codec

    out.mkdir(parents=True, exist_ok=True)
    for k, b in batches.items():
        (out / f"{k}.batch").write_bytes(codec.encode(b))
    script = out / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT), here=str(HERE), out=str(out), hf=str(tiny_dir), world=world,
                                    scenario=scenario, qwen=str(qwen) if qwen else ""))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world}", str(script)],
                          env=env, capture_output=True, text=True, timeout=500, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=0, atol=1e-5 * max(float(b.abs().max()), 1e-6))


def assert_same_grads(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], case: str) -> None:
    assert set(got) == set(ref), case
    assert any(float(v.abs().max()) > 0 for v in ref.values()), case  # the case has a gradient at all
    for k, want in ref.items():
        assert close(got[k], want), (case, k, float((got[k] - want).abs().max()), float(want.abs().max()))


def assert_same_weights(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], case: str, lr: float = 1e-2
                        ) -> None:
    """Weights after AdamW steps: its first steps move each weight by about ``lr * g / (|g| + eps)``, which
    amplifies fp32 noise in gradients near ``eps``; ``5 % of lr`` bounds that, while a missing or wrong update
    is off by about ``lr`` in most entries (the gradients themselves are compared tightly)."""
    assert set(got) == set(ref), case
    for k, want in ref.items():
        assert torch.allclose(got[k], want, rtol=0, atol=0.05 * lr), (case, k, float((got[k] - want).abs().max()))


def assert_same_metrics(got: dict[str, float], ref: dict[str, float], case: str) -> None:
    keys = [k for k in COMPARED if k in ref]
    assert "loss" in keys and "tokens" in keys, case
    assert set(keys) <= set(got), (case, sorted(got))
    for k in keys:
        assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), (case, k, got[k], ref[k])


def single_process_grads(tiny_dir: Path, tmp_path: Path, batches, cases=CASES):
    from consumers.parallel import Dist

    return run_grad_cases(tiny_dir, tmp_path / "single_grads", Dist(), batches, tp=1, world=1, cases=cases)


@pytest.mark.timeout(600)
def test_dp2_gradients_and_metrics_equal_single_process(tiny_dir: Path, tmp_path: Path, batches):
    from safetensors.torch import load_file

    out = tmp_path / "dp2"
    launch(tiny_dir, out, batches, world=2, scenario="dp")
    metrics = json.loads((out / "metrics.json").read_text())
    ref = single_process_grads(tiny_dir, tmp_path, batches)
    for name, _, _, _, which in CASES:
        ref_grads, ref_metrics = ref[name]
        assert_same_grads(load_file(str(out / f"grads_{name}.safetensors")), ref_grads, name)
        assert_same_metrics(metrics[name], ref_metrics, name)
        assert metrics[name]["tokens"] == float(batches[which].loss_mask.sum())


def assert_tp_matches_single(out: Path, tiny_dir: Path, tmp_path: Path, batches) -> None:
    from safetensors.torch import load_file

    from consumers.parallel import Dist

    ref = run_tp_steps(tiny_dir, tmp_path / "single_tp", Dist(), batches["uneven"], tp=1, world=1)
    info = json.loads((out / "tp.json").read_text())
    lp = load_file(str(out / "logprobs.safetensors"))["lp"]
    assert (lp - ref["logprobs"]).abs().max().item() < 1e-5
    assert_same_metrics(info["metrics"], ref["metrics"], "tp step")
    assert_same_grads(load_file(str(out / "grads.safetensors")), ref["grads"], "tp grads")
    for key in ("step1", "step2"):
        assert_same_weights(load_file(str(out / f"{key}.safetensors")), ref[key], key)
    # the HF export written after the TP step holds the full tensors of the 1-process step
    exported = load_file(str(Path(info["export"]) / "model.safetensors"))
    assert_same_weights(exported, ref["step1"], "export")
    # the checkpoint resumes: the weights of step 1, then the uninterrupted run's step 2 (optimizer state restored)
    assert info["restored_step"] == 1
    restored, step1 = load_file(str(out / "restored.safetensors")), load_file(str(out / "step1.safetensors"))
    assert all(torch.equal(restored[k], step1[k]) for k in step1)
    resumed2, step2 = load_file(str(out / "resumed2.safetensors")), load_file(str(out / "step2.safetensors"))
    assert all(torch.equal(resumed2[k], step2[k]) for k in step2)


def tied_qwen3_dir(out: Path) -> Path:
    """A tiny Qwen 3 (q/k norms, tied embeddings) in HF format."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    config = Qwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=96, vocab_size=64, max_position_embeddings=128,
                         tie_word_embeddings=True)
    Qwen3ForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.timeout(600)
def test_tp2_logprobs_step_export_and_resume_equal_single_process(tiny_dir: Path, tmp_path: Path, batches):
    out = tmp_path / "tp2"
    qwen = tied_qwen3_dir(tmp_path / "qwen3")
    launch(tiny_dir, out, batches, world=2, scenario="tp", qwen=qwen)
    assert_tp_matches_single(out, tiny_dir, tmp_path, batches)
    # Qwen 3: the q/k norms see head-sharded activations, the tied embedding is one vocab-sharded parameter
    from safetensors.torch import load_file

    from consumers.parallel import Dist

    ref, _ = run_grad_cases(qwen, tmp_path / "single_qwen", Dist(), batches, tp=1, world=1, cases=QWEN_CASES)["grpo"]
    assert_same_grads(load_file(str(out / "qwen_grads.safetensors")), ref, "qwen3 tied")


@pytest.mark.timeout(600)
def test_dp2_tp2_four_ranks_equal_single_process(tiny_dir: Path, tmp_path: Path, batches):
    from safetensors.torch import load_file

    out = tmp_path / "dp2tp2"
    launch(tiny_dir, out, batches, world=4, scenario="dptp")
    cases = [c for c in CASES if c[0] in ("grpo", "dapo_kl_entropy", "grpo_shared_prefix")]
    ref = single_process_grads(tiny_dir, tmp_path, batches, cases)
    metrics = json.loads((out / "metrics.json").read_text())
    for name, *_ in cases:
        assert_same_grads(load_file(str(out / f"grads_{name}.safetensors")), ref[name][0], name)
        assert_same_metrics(metrics[name], ref[name][1], name)
    assert_tp_matches_single(out, tiny_dir, tmp_path, batches)
