"""Zero-shot rewards of candidate tasks for a real model: which task gives GRPO a signal from the first step.

For each task (``--tasks``, feeder source specs) and each prompt rendering (plain text and the model's chat
template, as ``generator.chat_template`` renders it), samples ``--group-size`` responses of ``--prompts`` prompts
with bare vLLM ``LLM.generate`` (temperature 1, ``--max-tokens``) and scores them with the generator's own reward
builtins (``--rewards``, weighted by ``--weights``; each component's mean is reported). A task teaches GRPO only
through groups whose rewards differ: ``signal_groups`` counts them. One JSON line per (task, rendering), then a
last line ``{"bench": "zeroshot", "best": {...}}`` naming the rendering and task with the most signal groups.

    python bench/zeroshot.py --tasks toy:add1 toy:add2 reasoning_gym:spell_backward
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model.source name or an HF model dir")
    ap.add_argument("--tasks", nargs="+", default=["toy:add1", "toy:add2"])
    ap.add_argument("--rewards", nargs="+", default=["answer_format", "answer"])
    ap.add_argument("--weights", nargs="+", type=float, default=[0.25, 1.0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--system-prompt", default="", help="with the chat rendering: a system turn (empty: the model's)")
    ap.add_argument("--render", nargs="+", default=["plain", "chat"], choices=["plain", "chat"])
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from models.hf_models import SOURCES, ensure_source_model
    from producers.prompts import PromptChecker
    from producers.rewards import RewardSet
    from producers.sources import open_source

    model = str(ensure_source_model(args.model)) if args.model in SOURCES else args.model
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0, disable_log_stats=True)
    tok = llm.get_tokenizer()
    params = SamplingParams(n=args.group_size, max_tokens=args.max_tokens, temperature=args.temperature)
    rewards = RewardSet(args.rewards, args.weights, timeout_s=120)
    best = None
    for spec in args.tasks:
        prompts = list(open_source(spec, seed=1, num_prompts=args.prompts))
        for render in args.render:
            checker = PromptChecker(tok, max_model_len=512, max_tokens=args.max_tokens, vocab_size=lambda: 0,
                                    chat_template=render == "chat",
                                    system_prompt=args.system_prompt if render == "chat" else "")
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=checker.render(p.text)) for p in prompts], params,
                                use_tqdm=False)
            gen_s = time.perf_counter() - t0
            totals: dict[str, float] = {}
            reward_sum = signal = n = 0
            lengths = []
            for p, o in zip(prompts, outs):
                scored = asyncio.run(rewards.score_group(p, [c.text for c in o.outputs]))
                group = []
                for s, c in zip(scored, o.outputs):
                    group.append(s.reward)
                    reward_sum += s.reward
                    n += 1
                    lengths.append(len(c.token_ids))
                    for k, v in s.components.items():
                        totals[k] = totals.get(k, 0.0) + v
                signal += len(set(group)) > 1
            row = {"task": spec, "render": render, "temperature": args.temperature, "reward_mean": round(reward_sum / n, 4),
                   **{f"{k}_mean": round(v / n, 4) for k, v in totals.items()},
                   "signal_groups": signal, "groups": len(prompts),
                   "response_tokens_mean": round(sum(lengths) / len(lengths), 1), "generate_s": round(gen_s, 1),
                   "sample": outs[0].outputs[0].text[:160]}
            print(orjson.dumps(row).decode(), flush=True)
            if best is None or (signal, reward_sum / n) > (best["signal_groups"], best["reward_mean"]):
                best = row
    rewards.close()
    print(orjson.dumps({"bench": "zeroshot", "model": args.model, "best": best}).decode(), flush=True)


if __name__ == "__main__":
    main()
