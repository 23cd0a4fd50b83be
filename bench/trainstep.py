"""Trainer-step benchmark: one GRPO step of ``consumers.engine.TrainEngine`` vs a plain transformers step, same rows.

SmolLM2-135M-Instruct (``model.source: smollm2-135m``), fp32, on ``--rows`` rows of ``--prompt`` prompt and
``--response`` response tokens (the shape of ``configs/smollm2.yaml``: 4 prompts x 8 samples). The baseline is the
step a TRL user runs, in transformers' own code: ``AutoModelForCausalLM`` forward with ``logits_to_keep`` (TRL's
way of projecting the completion only), log-softmax and gather at the response tokens, the GRPO token loss,
backward, ``clip_grad_norm_`` and ``torch.optim.AdamW``. streamforge's step is ``TrainEngine.step`` on the same
``Batch`` (``scored``: the lm_head at the response tokens only), as the lever's control the same step with the
projection of every position (``StepInputs.scored = None``), and the step in shared-prefix rows
(``trainer.shared_prefix``: each group's prompt once, ``consumers/prefix.py``). The rows are groups of 8 samples
of one prompt, as GRPO's are. The four run in turn, the order reversed every round, after ``--warmup`` uncounted
rounds; each ratio is the median over ``--pairs`` rounds of (baseline seconds) / (streamforge seconds), so > 1
means streamforge is faster.
Last line: ``{"bench": "trainstep", "step_vs_transformers": X, "full_logits_vs_transformers": Y,
"scored_speedup": Y_s / X_s, "shared_prefix_vs_transformers": Z, "shared_prefix_speedup": X_s / Z_s, ...}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_check import synthetic_batch  # GRPO-shaped random rows, shared with bench/gpu_check.py

from consumers.config import TrainerConfig
from consumers.engine import TrainEngine
from consumers.parallel import Dist
from consumers.step import batch_inputs, rl_step
from topics.schemas import Batch


class TransformersStep:
    """The baseline: transformers' model and torch's AdamW, the loss as TRL computes it (``logits_to_keep``)."""

    def __init__(self, model_dir: Path, lr: float) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=True)  # TRL's default: adamw_torch_fused

    def step(self, batch: Batch, response: int) -> float:
        t0 = time.perf_counter()
        ids = torch.as_tensor(batch.input_ids, dtype=torch.long)
        mask = torch.as_tensor(batch.loss_mask[:, -response:], dtype=torch.float32)
        old = torch.as_tensor(batch.old_logprobs[:, -response:])
        adv = torch.as_tensor(batch.advantages)
        logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=response + 1).logits
        logits = logits[:, :-1].float()  # the position before each response token predicts it
        lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, -response:].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(lp - old)
        per_token = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.2) * adv[:, None])
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=36)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="uncounted rounds first (the first counted step of a path "
                   "after a single warm-up round ran up to 1.9x its later ones)")
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args()

    from models.hf_models import ensure_source_model

    torch.manual_seed(0)
    model_dir = ensure_source_model(args.model)
    vocab = orjson.loads((model_dir / "config.json").read_bytes())["vocab_size"]
    cfg = TrainerConfig(loss="grpo", lr=1e-6, export_hf=False, grad_clip=1.0)
    eng = TrainEngine(cfg, model_dir=model_dir, run_dir=tempfile.mkdtemp(), d=Dist(),
                      max_seq_len=args.prompt + args.response)
    shared = TrainEngine(TrainerConfig(loss="grpo", lr=1e-6, export_hf=False, grad_clip=1.0, shared_prefix=True),
                         model_dir=model_dir, run_dir=tempfile.mkdtemp(), d=Dist(),
                         max_seq_len=args.prompt + args.response)
    base = TransformersStep(model_dir, lr=1e-6)

    def full_logits(batch: Batch) -> float:
        inputs = batch_inputs(batch)
        inputs.scored = None
        return rl_step(eng.policy.model, eng.opt, eng.sched, eng.loss_fn, inputs, grad_clip=cfg.grad_clip)["step_s"]

    def timed(engine: TrainEngine) -> Callable[[Batch], float]:
        def run(batch: Batch) -> float:
            t0 = time.perf_counter()
            engine.step(batch)
            return time.perf_counter() - t0
        return run

    paths: dict[str, Callable[[Batch], float]] = {
        "streamforge": timed(eng), "full_logits": full_logits,
        "transformers": lambda batch: base.step(batch, args.response), "shared_prefix": timed(shared)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(args.warmup + args.pairs):  # the warm-up rounds are not counted
        batch = synthetic_batch(rows=args.rows, prompt=args.prompt, response=args.response, vocab=vocab, seed=i)
        batch.input_ids[:, :args.prompt] = batch.input_ids[::8, :args.prompt].repeat(8, axis=0)[:args.rows]
        order = list(paths) if i % 2 == 0 else list(paths)[::-1]  # no path always first after another's step
        took = {name: paths[name](batch) for name in order}
        print(f"round {i}{' (warm-up)' if i < args.warmup else ''}: "
              + ", ".join(f"{name} {took[name]:.2f} s" for name in order), flush=True)
        if i >= args.warmup:
            for name, t in took.items():
                times[name].append(t)
    ratio = statistics.median(t / s for t, s in zip(times["transformers"], times["streamforge"]))
    ratio_full = statistics.median(t / s for t, s in zip(times["transformers"], times["full_logits"]))
    scored = statistics.median(f / s for f, s in zip(times["full_logits"], times["streamforge"]))
    ratio_shared = statistics.median(t / s for t, s in zip(times["transformers"], times["shared_prefix"]))
    shared_speedup = statistics.median(f / s for f, s in zip(times["streamforge"], times["shared_prefix"]))
    print(orjson.dumps({
        "bench": "trainstep", "step_vs_transformers": round(ratio, 3),
        "full_logits_vs_transformers": round(ratio_full, 3), "scored_speedup": round(scored, 3),
        "shared_prefix_vs_transformers": round(ratio_shared, 3), "shared_prefix_speedup": round(shared_speedup, 3),
        "shared_prefix_s": round(statistics.median(times["shared_prefix"]), 3),
        "streamforge_s": round(statistics.median(times["streamforge"]), 3),
        "transformers_s": round(statistics.median(times["transformers"]), 3),
        "rows": args.rows, "tokens": args.prompt + args.response, "threads": torch.get_num_threads(),
    }).decode())


if __name__ == "__main__":
    main()
