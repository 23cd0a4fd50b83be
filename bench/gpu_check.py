"""One short check of the trainer's and weight sync's CUDA paths, for a machine with one GPU (no brokers, no vLLM).

``python bench/gpu_check.py [--out DIR]`` runs, each part on its own so one failure does not hide the others:

1. ``parity``: the tiny test model's first GRPO step through ``TrainEngine`` on CPU fp32, CUDA fp32, CUDA bf16 and
   CUDA fp32 in shared-prefix rows (``trainer.shared_prefix``: SDPA under a dense mask) from the same weights and
   batch: loss, grad norm and the updated weights must agree (fp32 to 1e-4, bf16 to 5e-2).
2. ``losses``: every registered loss on CPU and CUDA (fp32) on the same random tensors: loss and gradient agree.
3. ``throughput``: a 1.1B-parameter Llama (TinyLlama's shape, random weights, untied) trained with GRPO steps in
   bf16 through ``TrainEngine`` on 64 x 512-token rows: seconds per step, tokens/s, and model TFLOP/s
   (6 * params * tokens / time, attention not counted).
4. ``snapshot``: ``weightsync.wire.pack`` of that model's HF-named tensors into CUDA buckets (the nccl sender's
   source), checked byte for byte against the CPU pack, with its time.

Prints one JSON object per part and ends with one JSON line ``{"bench": "gpu_check", ...}``. It needs torch with
CUDA, torchtitan (and its imports), safetensors, transformers, msgpack and orjson; nothing else of the project's
dependencies. Without CUDA it prints ``{"bench": "gpu_check", "skipped": ...}`` and exits 0 (``make bench`` runs it).

On the lent GPU machine (its own image: torch 2.11 with CUDA, transformers, safetensors, msgpack; no network) carry
the rest as wheels in a folder git ignores: here, ``pip download --no-deps --only-binary=:all: --python-version 3.12
--implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform
manylinux_2_28_x86_64 -d .gpuwheels torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0
typeguard==4.6.1 orjson==3.13.0 msgspec==0.23.0``; there, ``python3 -m pip install --no-deps --no-index --target
/tmp/wh .gpuwheels/*.whl`` and ``PYTHONPATH=/tmp/wh:$PWD python3 bench/gpu_check.py --out $OUT``. torchtitan 0.3.0
imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.13) at module import; one GPU uses no FSDP, so
on an older torch the check defines a placeholder for that name (below) and says so in its ``env`` part.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed.fsdp as _fsdp

FSDP_PLACEHOLDER = not hasattr(_fsdp, "DataParallelMeshDims")
if FSDP_PLACEHOLDER:  # torch < 2.13 (module docstring): a name torchtitan imports, never used on one GPU

    class _NoMeshDims:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("torch.distributed.fsdp.DataParallelMeshDims needs torch >= 2.13")

    _fsdp.DataParallelMeshDims = _NoMeshDims

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from consumers.config import TrainerConfig
from consumers.engine import TrainEngine
from consumers.losses import loss_names, make_loss
from consumers.parallel import Dist
from topics.schemas import Batch

CUDA = torch.device("cuda", 0)


def synthetic_batch(*, rows: int, prompt: int, response: int, vocab: int, seed: int, group: int = 8) -> Batch:
    """GRPO-shaped random rows: ``prompt`` prompt tokens then ``response`` response tokens (the mask), behaviour
    logprobs near the policy's, group-normalised random advantages."""
    rng = np.random.default_rng(seed)
    t = prompt + response
    ids = rng.integers(3, vocab, size=(rows, t), dtype=np.int32)
    mask = np.zeros((rows, t), np.uint8)
    mask[:, prompt:] = 1
    rewards = rng.integers(0, 2, size=rows).astype(np.float32)
    r = rewards.reshape(-1, group)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)).reshape(-1).astype(np.float32)
    old = np.where(mask == 1, -np.log(vocab) + rng.normal(0, 0.05, size=(rows, t)), 0).astype(np.float32)
    return Batch(batch_id=f"gpu-check-{seed}", episode_ids=[f"e{seed}-{i}" for i in range(rows)],
                 group_ids=[f"g{seed}-{i // group}" for i in range(rows)], input_ids=ids, loss_mask=mask,
                 old_logprobs=old, token_versions=np.where(mask == 1, 0, -1).astype(np.int32), advantages=adv,
                 rewards=rewards, prompt_lens=np.full(rows, prompt, np.int32), seq_lens=np.full(rows, t, np.int32))


def engine(model_dir: Path, device: torch.device, dtype: str, *, max_seq_len: int,
           shared_prefix: bool = False) -> TrainEngine:
    cfg = TrainerConfig(loss="grpo", lr=1e-4, dtype=dtype, export_hf=False, grad_clip=1.0,
                        shared_prefix=shared_prefix)
    return TrainEngine(cfg, model_dir=model_dir, run_dir=tempfile.mkdtemp(), d=Dist(device=device),
                       max_seq_len=max_seq_len)


def part_parity(work: Path) -> dict:
    from models.tiny_model import build_tiny_model

    model_dir = build_tiny_model(work / "tiny", seed=0)
    cfg = json.loads((model_dir / "config.json").read_text())
    batch = synthetic_batch(rows=16, prompt=6, response=4, vocab=cfg["vocab_size"], seed=1)
    batch.input_ids[:, :6] = batch.input_ids[::8, :6].repeat(8, axis=0)  # GRPO groups of 8 share their prompt
    out = {}
    weights = {}
    for name, device, dtype, shared in (("cpu_fp32", torch.device("cpu"), "float32", False),
                                        ("cuda_fp32", CUDA, "float32", False),
                                        ("cuda_bf16", CUDA, "bfloat16", False),
                                        ("cuda_fp32_shared_prefix", CUDA, "float32", True)):
        torch.manual_seed(0)
        e = engine(model_dir, device, dtype, max_seq_len=64, shared_prefix=shared)
        m = e.step(batch)
        out[name] = {"loss": m["loss"], "grad_norm": m.get("grad_norm")}
        weights[name] = {k: v.float().cpu() for k, v in e.named_tensors()}
        del e
    diff = {n: max((weights[n][k] - weights["cpu_fp32"][k]).abs().max().item() for k in weights[n])
            for n in ("cuda_fp32", "cuda_bf16", "cuda_fp32_shared_prefix")}
    out["max_weight_diff"] = diff
    shared = out["cuda_fp32_shared_prefix"]
    out["ok"] = (abs(out["cuda_fp32"]["loss"] - out["cpu_fp32"]["loss"]) < 1e-4 and diff["cuda_fp32"] < 1e-4
                 and abs(out["cuda_bf16"]["loss"] - out["cpu_fp32"]["loss"]) < 5e-2 and diff["cuda_bf16"] < 5e-2
                 and abs(shared["loss"] - out["cpu_fp32"]["loss"]) < 1e-4 and diff["cuda_fp32_shared_prefix"] < 1e-4)
    return out


def part_losses() -> dict:
    g = torch.Generator().manual_seed(0)
    b, t = 16, 24
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + 0.1 * torch.randn(b, t, generator=g)
    ref = logp + 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    worst, failed = {}, []
    for name in loss_names():
        fn = make_loss(name, beta=0.04)  # with the k3 KL term, so ref_logprobs is exercised too
        res = {}
        for dev in ("cpu", CUDA):
            x = logp.clone().to(dev).requires_grad_(True)
            loss, _ = fn(x, old.to(dev), adv.to(dev), mask.to(dev), ref.to(dev))
            loss.backward()
            res[dev] = (loss.item(), x.grad.cpu())
        d = max(abs(res["cpu"][0] - res[CUDA][0]), (res["cpu"][1] - res[CUDA][1]).abs().max().item())
        worst[name] = d
        if not d < 1e-5:
            failed.append(name)
    return {"max_abs_diff": worst, "failed": failed, "ok": not failed}


def write_llama(out: Path) -> Path:
    """A TinyLlama-shaped (1.1B) untied Llama HF dir with random bf16 weights."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
    with torch.device(CUDA):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def part_throughput(work: Path, steps: int, rows: int = 64, seq: int = 512) -> tuple[dict, TrainEngine]:
    model_dir = write_llama(work / "llama1b")
    e = engine(model_dir, CUDA, "bfloat16", max_seq_len=seq)
    params = sum(p.numel() for p in e.policy.model.parameters())
    batches = [synthetic_batch(rows=rows, prompt=seq // 4, response=seq - seq // 4, vocab=32000, seed=s)
               for s in range(steps + 2)]
    for b in batches[:2]:  # warm-up: allocator, kernels
        e.step(b)
    torch.cuda.synchronize()
    times, losses = [], []
    for b in batches[2:]:
        t0 = time.perf_counter()
        m = e.step(b)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(m["loss"])
    s = float(np.median(times))
    tokens = rows * seq
    return ({"params": params, "rows": rows, "seq": seq, "steps": steps, "s_per_step_median": round(s, 4),
             "s_per_step_min": round(min(times), 4), "tokens_per_s": round(tokens / s),
             "model_tflops": round(6 * params * tokens / s / 1e12, 1),
             "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
             "losses_finite": all(np.isfinite(losses)), "ok": all(np.isfinite(losses))}, e)


def part_snapshot(e: TrainEngine) -> dict:
    from consumers.model import hf_named_tensors
    from weightsync.wire import pack

    bucket = 256 << 20
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gpu = pack(hf_named_tensors(e.policy), version=1, step=1, bucket_bytes=bucket, device=CUDA)
    gpu_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cpu = pack(hf_named_tensors(e.policy), version=1, step=1, bucket_bytes=bucket, device="cpu")
    cpu_s = time.perf_counter() - t0
    same = gpu.layout == cpu.layout and all(torch.equal(g.cpu(), c) for g, c in zip(gpu.buffers, cpu.buffers))
    return {"bytes": gpu.nbytes, "buckets": len(gpu.buffers), "pack_cuda_s": round(gpu_s, 4),
            "pack_cpu_s": round(cpu_s, 4), "cuda_gb_per_s": round(gpu.nbytes / gpu_s / 1e9, 1),
            "identical": same, "ok": same}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():  # `make bench` runs every script: here there is nothing to check
        print(json.dumps({"bench": "gpu_check", "skipped": "no CUDA device"}), flush=True)
        return 0
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    print(json.dumps({"part": "env", **env, "fsdp_placeholder": FSDP_PLACEHOLDER}), flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    results: dict[str, dict] = {}
    eng = None

    def run(name, fn):
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as exc:  # noqa: BLE001 - one part failing must not hide the others
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        results[name] = res
        print(json.dumps({"part": name, **res}, default=str), flush=True)
        return res

    run("parity", lambda: part_parity(work))
    run("losses", part_losses)

    def throughput():
        nonlocal eng
        res, eng = part_throughput(work, args.steps)
        return res

    run("throughput", throughput)
    if eng is not None:
        run("snapshot", lambda: part_snapshot(eng))
    summary = {"bench": "gpu_check", **env, "ok": {k: v.get("ok") for k, v in results.items()},
               "s_per_step": results.get("throughput", {}).get("s_per_step_median"),
               "tokens_per_s": results.get("throughput", {}).get("tokens_per_s"),
               "model_tflops": results.get("throughput", {}).get("model_tflops")}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(results, default=str, indent=1))
    print(json.dumps(summary, default=str), flush=True)
    return 0 if all(v.get("ok") for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
