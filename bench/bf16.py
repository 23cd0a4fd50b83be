"""The bf16 lever on a CPU with ``avx512_bf16``: vLLM generation and the trainer step in bf16 against fp32, and the
logprob drift bf16 brings.

SmolLM2-135M-Instruct (``model.source: smollm2-135m``). Three measurements, each side by side in one run:

- generation: bare vLLM ``LLM.generate`` (sampling, ``--prompts`` x ``--samples`` x ``--max-tokens``), an engine in
  ``dtype="float32"`` (what ``producers/engine.py`` uses) against one in ``"bfloat16"``, alternated ``--pairs``
  times (each engine in its own subprocess, since a vLLM CPU engine keeps its threads; the median of each side's
  rounds is compared);
- the trainer step: ``consumers.engine.TrainEngine.step`` with ``trainer.dtype`` float32 against bfloat16 (bf16
  parameters and AdamW state: no fp32 master weights) and against ``trainer.autocast`` (float32 parameters, the
  step under ``torch.autocast("cpu", torch.bfloat16)``: bf16 matmuls, fp32 master weights), alternated on the
  same rows;
- drift: the per-token logprobs of the same rows under the bf16 weights (and under autocast) and the fp32
  weights (the mismatch an importance ratio between a bf16 generator and an fp32 trainer would carry): mean and
  max ``|lp_bf16 - lp_fp32|`` and the mean ``exp(|diff|) - 1``.

Last line: ``{"bench": "bf16", "generate_bf16_vs_fp32": G, "step_bf16_vs_fp32": S, "logprob_drift_mean": D,
"logprob_drift_max": M, "step_autocast_vs_fp32": A, ...}`` (ratios > 1: bf16 faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def generate_once(model: str, dtype: str, prompts: int, samples: int, max_tokens: int, rounds: int) -> None:
    """In a subprocess: one vLLM engine in ``dtype``; prints one JSON line of per-round tokens/s."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=256, seed=0)
    params = SamplingParams(n=samples, max_tokens=max_tokens, min_tokens=max_tokens, temperature=1.0, logprobs=0)
    texts = [f"Question {i}: what is {i} plus {i + 3}? Answer:" for i in range(prompts)]
    llm.generate(texts[:1], params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = llm.generate(texts, params, use_tqdm=False)
        n = sum(len(c.token_ids) for o in outs for c in o.outputs)
        rates.append(n / (time.perf_counter() - t0))
    print(orjson.dumps({"dtype": dtype, "tokens_per_s": rates}).decode(), flush=True)


def generation(model: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for _ in range(args.pairs):
        for dtype in ("float32", "bfloat16"):
            out = subprocess.run([sys.executable, __file__, "--generate-one", dtype, "--model-dir", str(model),
                                  "--prompts", str(args.prompts), "--samples", str(args.samples),
                                  "--max-tokens", str(args.max_tokens)],
                                 capture_output=True, text=True, timeout=900, check=True)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
            rates[dtype] += orjson.loads(line)["tokens_per_s"]
            print(f"generate {dtype}: {rates[dtype][-1]:.0f} tokens/s", flush=True)
    return rates


def train_and_drift(model: Path, args: argparse.Namespace) -> tuple[list[float], dict[str, float]]:
    import torch
    from gpu_check import synthetic_batch

    from consumers.config import TrainerConfig
    from consumers.engine import TrainEngine
    from consumers.model import token_logprobs
    from consumers.parallel import Dist
    from consumers.step import batch_inputs

    vocab = orjson.loads((model / "config.json").read_bytes())["vocab_size"]
    engines = {}
    for dtype in ("float32", "bfloat16", "autocast"):
        cfg = TrainerConfig(loss="grpo", lr=1e-6, export_hf=False, grad_clip=1.0, autocast=dtype == "autocast",
                            dtype="float32" if dtype == "autocast" else dtype)
        engines[dtype] = TrainEngine(cfg, model_dir=model, run_dir=tempfile.mkdtemp(), d=Dist(),
                                     max_seq_len=args.prompt + args.response)
    # drift first, on the untouched weights of both
    batch = synthetic_batch(rows=args.rows, prompt=args.prompt, response=args.response, vocab=vocab, seed=99)
    lps = {}
    with torch.no_grad():
        for dtype, eng in engines.items():
            inputs = batch_inputs(batch)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast"):
                lp, _ = token_logprobs(eng.policy.model, inputs.input_ids, scored=inputs.scored)
            lps[dtype] = lp[:, -args.response:].float()
    diff = (lps["bfloat16"] - lps["float32"]).abs()
    mixed = (lps["autocast"] - lps["float32"]).abs()
    drift = {"logprob_drift_mean": round(float(diff.mean()), 5), "logprob_drift_max": round(float(diff.max()), 4),
             "ratio_error_mean": round(float((diff.exp() - 1).mean()), 5),
             "autocast_drift_mean": round(float(mixed.mean()), 5),
             "autocast_drift_max": round(float(mixed.max()), 4)}
    times: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(args.pairs + 1):  # round 0 warms up
        batch = synthetic_batch(rows=args.rows, prompt=args.prompt, response=args.response, vocab=vocab, seed=i)
        for dtype, eng in engines.items():
            t0 = time.perf_counter()
            eng.step(batch)  # trainer.autocast: the engine enters torch.autocast itself
            s = time.perf_counter() - t0
            print(f"round {i}: step {dtype} {s:.2f} s", flush=True)
            if i:
                times[dtype].append(s)
    ratios = [f / b for f, b in zip(times["float32"], times["bfloat16"])]
    autocast = [f / b for f, b in zip(times["float32"], times["autocast"])]
    return ratios, {**drift, "step_autocast_vs_fp32": round(statistics.median(autocast), 3),
                    "step_autocast_s": round(statistics.median(times["autocast"]), 3), "step_fp32_s": round(statistics.median(times["float32"]), 3),
                    "step_bf16_s": round(statistics.median(times["bfloat16"]), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--model-dir", default="")
    p.add_argument("--generate-one", default="", help=argparse.SUPPRESS)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=36)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--skip-generate", action="store_true")
    args = p.parse_args()
    if args.generate_one:
        generate_once(args.model_dir, args.generate_one, args.prompts, args.samples, args.max_tokens, rounds=2)
        return

    from models.hf_models import ensure_source_model

    model = Path(args.model_dir) if args.model_dir else ensure_source_model(args.model)
    result: dict[str, object] = {"bench": "bf16"}
    if not args.skip_generate:
        rates = generation(model, args)
        result["generate_bf16_vs_fp32"] = round(statistics.median(rates["bfloat16"]) /
                                                statistics.median(rates["float32"]), 3)
        result["generate_fp32_tokens_per_s"] = round(statistics.median(rates["float32"]), 1)
        result["generate_bf16_tokens_per_s"] = round(statistics.median(rates["bfloat16"]), 1)
    ratios, extra = train_and_drift(model, args)
    result["step_bf16_vs_fp32"] = round(statistics.median(ratios), 3)
    result.update(extra)
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
