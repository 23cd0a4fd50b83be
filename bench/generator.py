"""Generator benchmark: tokens/s of one generator producing Episodes to the topic vs bare vLLM ``LLM.generate``.

Same run, same tiny model, same prompts (``--prompts`` addmod10 prompts, ``--group-size`` samples each) and the same
sampling (temperature 1, ``--max-tokens``, the sampled token's logprob), ``--rounds`` alternating rounds with fresh
prompts (the machine is shared: alternating spreads the noise over both). After the warm-up the process's heap is
frozen (``gc.freeze``), as every role's process does once started: otherwise a full collection of vLLM's and torch's
objects (0.5-0.8 s) falls into a round at random, mostly the generator's (it allocates more). Bare vLLM:
``LLM.generate`` on all prompts of the round at once, timed around the call. Generator: the round's prompts are fed
to the ``prompts`` topic of embedded brokers, a ``GeneratorRole`` with its own ``AsyncLLM`` engine takes them all
concurrently and produces every scored Episode to the ``episodes`` topic; timed from the first prompt taken to the
last Episode acknowledged (the consumer-group join before it is excluded). Both engines are warmed up first and stay
alive (one at a time works). Each round gives a pair of rates (tokens / seconds); X is the median over the rounds of
the pair's ratio (a round's noise hits both sides of its pair alike, and one disturbed round does not move a
median); ``total_vs_vllm`` is total tokens / total seconds of each side instead. Tokens are response tokens actually
generated (random-model responses end at EOS at random, so both sides count what they made).
Last line: ``{"bench": "generator", "tokens_per_s_vs_vllm": X, ...}`` (goal: X >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


class BareVLLM:
    """``LLM.generate`` on all prompts at once, timed around the call (after a warm-up request)."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len, seed=0,
                       logprobs_mode="processed_logprobs", disable_log_stats=True)
        self.params = SamplingParams(n=args.group_size, max_tokens=args.max_tokens, temperature=1.0, logprobs=0)

    def run(self, token_prompts: list[list[int]]) -> tuple[int, float]:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], self.params,
                                 use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return sum(len(c.token_ids) for o in outs for c in o.outputs), elapsed

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


async def run_generator(cfg, engine, prompts: list, group_size: int) -> tuple[int, float]:
    """Feed ``prompts`` to the topic, run a GeneratorRole until all their Episodes are acked; time it."""
    from streamforge.roles import build_role
    from topics.kafka import Producer

    async with Producer(cfg.kafka) as producer:
        for p in prompts:
            await producer.send(cfg.names.prompts, p, key=p.prompt_id)
    role = build_role("generator", cfg, engine=engine)
    stop = asyncio.Event()
    task = asyncio.create_task(role.serve(stop))
    want = len(prompts) * group_size
    deadline = time.monotonic() + 600
    while role.stats["episodes"] < want:
        if task.done():
            task.result()
            raise RuntimeError("the generator stopped early")
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {role.stats['episodes']} of {want} episodes after 600 s")
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - role.first_taken_at
    stop.set()
    await task
    return role.stats["tokens"], elapsed


async def compare(model: str, args: argparse.Namespace, work: Path) -> tuple[list, list]:
    """Alternate bare vLLM and the generator ``--rounds`` times (fresh prompts each round) to share the noise."""
    from producers import vllm_poll
    from producers.engine import Engine, Sampling
    from producers.sources import toy_prompts
    from streamforge.brokers import EmbeddedBrokers
    from streamforge.config import load_config
    from topics.admin import ensure_topics

    brokers = EmbeddedBrokers(work / "brokers")
    await brokers.start()
    engine = Engine(model, max_model_len=args.max_model_len, seed=0)
    bare = None
    try:
        cfg = load_config(None, [
            f"--kafka.bootstrap={brokers.kafka_bootstrap}", f"--nats.url={brokers.nats_url}",
            f"--run.run_dir={work / 'run'}", "--run.prefix=bench", f"--model.path={model}",
            f"--generator.group_size={args.group_size}", f"--generator.max_tokens={args.max_tokens}",
            f"--generator.max_concurrent_prompts={args.prompts}", "--generator.rewards=[toy]",
            "--generator.generator_id=bench", "--staleness.max_versions=-1",  # no trainer: no quota, no lag
        ], environ={})
        await ensure_topics(cfg.kafka, cfg.names, cfg.topics)
        # both engines' processes poll their queues alike (the role's default, producers/vllm_poll.py): with vLLM's
        # own 1 s, the idle engine's worker would poll through the other's round
        vllm_poll.set_poll_s(engine.poll_s)
        bare = BareVLLM(model, args)
        await engine.start()
        tok = engine.tokenizer
        source = toy_prompts("addmod10", seed=0)
        warm = tok(next(source).text)["input_ids"]
        bare.run([warm])
        await engine.generate(warm, args.group_size, Sampling(max_tokens=4))
        # as a role's process does once started (``serve(freeze_heap=True)``, runtime/lifecycle.py): without it a
        # full collection scans vLLM's and torch's heap (0.5-0.8 s here) and lands in a round at random
        gc.collect()
        gc.freeze()
        v_runs, g_runs = [], []
        for _ in range(args.rounds):
            prompts = [p for _, p in zip(range(args.prompts), source)]
            v_runs.append(bare.run([tok(p.text)["input_ids"] for p in prompts]))
            g_runs.append(await run_generator(cfg, engine, prompts, args.group_size))
        return v_runs, g_runs
    finally:
        if bare is not None:
            bare.close()
        await engine.stop()
        brokers.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from models.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = str(build_tiny_model(work / "model", seed=0))
        v_runs, g_runs = asyncio.run(compare(model, args, work))
    for (vt, vs), (gt, gs) in zip(v_runs, g_runs):
        print(f"bare vLLM LLM.generate {vt / vs:7.0f} tok/s ({vt} in {vs:.2f} s) | "
              f"generator -> episodes topic {gt / gs:7.0f} tok/s ({gt} in {gs:.2f} s)")
    v_rate = sum(t for t, _ in v_runs) / sum(s for _, s in v_runs)
    g_rate = sum(t for t, _ in g_runs) / sum(s for _, s in g_runs)
    pairs = statistics.median((gt / gs) / (vt / vs) for (vt, vs), (gt, gs) in zip(v_runs, g_runs))
    print(orjson.dumps({"bench": "generator", "tokens_per_s_vs_vllm": round(pairs, 3),
                        "total_vs_vllm": round(g_rate / v_rate, 3), "rounds": len(g_runs),
                        "generator_tokens_per_s": round(g_rate, 1), "vllm_tokens_per_s": round(v_rate, 1),
                        "prompts": args.prompts, "group_size": args.group_size,
                        "max_tokens": args.max_tokens}).decode())


if __name__ == "__main__":
    main()
