"""End-to-end benchmark: time to mean reward 0.8 for TRL's GRPOTrainer, streamforge sync and streamforge async.

Same tiny model (``models/tiny_model.py``, warm-started like the demo), task, group size, learning rate and seed for all three, in one run
on one machine. Each system gets a wall-clock budget; time is measured from the first training step (start-up of
brokers, engines and processes excluded, for all three alike) to the step whose running mean reward (window
``--window`` steps) first reaches ``--target``. A system that does not reach the target within its budget reports
``null`` for its time (and the reward it reached), and the ratios that need it are ``null``.

* TRL: ``trl.GRPOTrainer`` (install the ``bench`` extra), generation with transformers on CPU, ``beta=0``.
* streamforge sync: ``streamforge.train`` with ``staleness.max_versions: 0`` (every batch from the latest weights;
  the buffer's and generators' bounds derive from it: one batch ahead, no lag) and ``trainer.publish_busy: wait``
  (the trainer waits for each swap).
* streamforge async: the demo's settings (``configs/demo.yaml``): ``staleness.max_versions: 4``
  (``--async-staleness``) and ``publish_busy: skip`` (generation and swaps overlap training), with
  ``trainer.publish_every: 3`` (``--async-publish-every``): a swap stops the generator longer than a 2-token
  generation takes; swapping every other step reached the target in 35 s against 64 s, and every third step
  before every other one in 3 of 3 alternated rounds (bench/RESULTS.md).
  ``--sf KEY=VALUE`` sets more streamforge keys for both modes.
* Both streamforge modes pin the generator's engine (vLLM's engine core and worker) to one core,
  ``generator.cpus`` = the last core this process may use (``--generator-cpus``; '' leaves them unpinned). On a
  2-core host vLLM's engine core and worker hand each step to each other through shared-memory queues that they
  poll; pinned, their polls stay off the core the trainer, buffer and brokers use. The generator's own process
  (Kafka, rewards, spans, vLLM's output handling: about a third of a core) moves to every core once its engine has
  started (``generator.loop_cpus``), so it no longer takes turns with the engine; with it moved, the async mode runs
  24 prompts at once (``--async-prompts``; 8 in the sync mode, whose quota allows one batch ahead): against the whole
  generator on one core with 8, its median time to target went from 18.3 to 15.2 s with 16 (3 of 3 alternated
  rounds), and 24 and 32 read 15.7 and 14.9 s against 16.2 s with 16 in a second set (bench/RESULTS.md). The async mode's engine runs the
  model in its engine core's process (``generator.vllm_executor: uni``: faster pinned, in 3 of 3 alternated async
  pairs; the sync mode keeps vLLM's executor, with which it reached the target in 107 s against 548 s with
  ``uni``, bench/RESULTS.md). In alternated async runs the
  pinned generator reached 0.8 in 20.9-35.1 s (median 24.4, 11 runs), unpinned in 25.6-33.2 s (median 30.7, 6
  runs); the machine's speed drifted as much within the hour (bench/RESULTS.md, 2026-12-04).

Both streamforge modes keep the episodes in one partition (``RLConfig.episodes_partitions``, as the demo: their one
buffer forms each batch from one partition's groups; with 4 the sync mode dropped 58% of its episodes as stale and
took 135 s against 40 s) and train in shared-prefix rows, as the demo (``trainer.shared_prefix``: a group's prompt once
per row; ``--sf trainer.shared_prefix=false`` pads every sample's copy), and drop zero-variance groups
(``--filter-zero-variance 0`` turns that off); TRL does not, so the comparison with TRL is of the two systems as
configured, the one with sync of asynchrony alone. Its
``reward`` and streamforge's ``reward_mean`` are both the mean over every sampled completion.

Rounds: ``--rounds`` (default 3) runs every system once per round, the order alternating round by round, on the
same warm-started model; each ``*_s`` key is the median of that system's times and each ``speedup_*`` the median of
the rounds' ratios (``bench/reading.py``: a missed target counts as infinitely slow), ``rounds`` lists every time.
One round is no reading: on one day TRL took 6.9-8.9 s and async 13.3-15.5 s, single rounds read ``speedup_vs_trl``
0.465-0.582 (bench/RESULTS.md, 2026-12-05). ``--breakdown`` reads the last round's runs.

Sync and async share every setting but those the output's ``differences`` lists, each with both values and its
reason (``WHY_DIFFERENT``: the two that make the modes, and three measured levers the other mode does not gain
from); ``settings`` has each mode's full list. A difference without a stated reason stops the bench at start.

Variants: ``--task addmod10 --max-tokens 2`` (default) and a generation-heavy one, e.g. ``--task reverse
--max-tokens 8``. Last line: ``{"bench": "e2e", "trl_s": A, "sync_s": B, "async_s": C, "speedup_vs_trl": A/C,
"speedup_vs_sync": B/C, ..., "rounds": {...}, "settings": {...}, "differences": {...}}``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.reading import median, ratio  # how several rounds are read, shared with bench/realmodel.py


def time_to_target(rows: list[tuple[float, float]], target: float, window: int) -> tuple[float | None, float]:
    """(seconds from the first row to the first running mean >= target, best running mean)."""
    if not rows:
        return None, 0.0
    t0, best = rows[0][0], 0.0
    for i in range(len(rows)):
        recent = [r for _, r in rows[max(0, i - window + 1): i + 1]]
        mean = sum(recent) / len(recent)
        best = max(best, mean)
        if len(recent) >= min(window, 5) and mean >= target:
            return rows[i][0] - t0, mean
    return None, best


def run_trl(model_dir: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import random

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from models.tasks import get_task
    from models.tiny_model import load_tokenizer

    task = get_task(args.task)
    rng = random.Random(args.seed)
    rows = [dict(zip(("prompt", "answer"), task.make_prompt(rng))) for _ in range(20_000)]
    rewards: list[tuple[float, float]] = []
    deadline = time.monotonic() + args.budget_s

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [task.score(c, a) for c, a in zip(completions, answer)]

    class Stop(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append((time.monotonic(), float(logs["reward"])))
                hit, _ = time_to_target(rewards, args.target, args.window)
                if hit is not None or time.monotonic() > deadline:
                    control.should_training_stop = True

    torch.manual_seed(args.seed)
    config = GRPOConfig(
        output_dir=str(out / "trl"), learning_rate=args.lr, num_generations=args.group_size,
        per_device_train_batch_size=args.group_size * args.prompts, max_completion_length=args.max_tokens,
        temperature=1.0, beta=0.0, logging_steps=1, max_steps=args.max_steps, report_to="none", use_cpu=True,
        bf16=False, gradient_checkpointing=False, save_strategy="no", seed=args.seed, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          reward_funcs=[reward], args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=load_tokenizer(model_dir), callbacks=[Stop()])
    trainer.train()
    secs, best = time_to_target(rewards, args.target, args.window)
    return {"seconds": secs, "best_reward": best, "steps": len(rewards)}


# Why a setting differs between the two streamforge modes (the module docstring): the output names every key
# that differs with its reason, and a difference with no reason here stops the bench.
WHY_DIFFERENT = {
    "staleness.max_versions": "the mode itself: sync trains every batch on the latest weights, async within a bound",
    "trainer.publish_busy": "the mode itself: sync waits for each swap, async never waits",
    "trainer.publish_every": "async swaps every few steps (a swap stops the generator longer than a 2-token "
                             "generation takes); sync publishes every step, which staleness 0 needs",
    "generator.max_concurrent_prompts": "sync's quota allows one batch ahead, so more prompts at once only wait; "
                                        "async runs more at once (the module docstring)",
    "generator.vllm_executor": "async pinned: the model in the engine core's process (faster there); sync keeps "
                               "vLLM's executor, faster for it (the module docstring)",
}


def mode_settings(args: argparse.Namespace, lag: int) -> dict[str, Any]:
    """Every streamforge setting this bench gives a mode (``lag`` 0: sync) beyond the shared ``RLConfig`` ones."""
    extra: dict[str, Any] = {"staleness.max_versions": lag, "trainer.reward_window": args.window,
                             "feeder.source": f"toy:{args.task}", "trainer.checkpoint_every": 1000,
                             "buffer.filter_zero_variance": args.filter_zero_variance,
                             "trainer.shared_prefix": True}  # as the demo: a group's prompt once per row (both)
    # sync (lag 0): every batch from the latest weights, the trainer waiting for each swap; async: the demo's
    # bound (the buffer's and generators' bounds derived) and a trainer that never waits
    extra["trainer.publish_busy"] = "wait" if lag == 0 else "skip"
    if lag:  # a swap stops the generator ~100-200 ms for a 2-token generation of ~30-60 ms: swap every third step
        extra["trainer.publish_every"] = args.async_publish_every
        extra["generator.max_concurrent_prompts"] = args.async_prompts
        if args.generator_cpus:  # pinned: the model in the engine core's process (the module docstring)
            extra["generator.vllm_executor"] = "uni"
    if args.generator_cpus:  # the engine on its core, the generator's own process on every core (the docstring)
        extra["generator.cpus"] = args.generator_cpus
        extra["generator.loop_cpus"] = args.loop_cpus
    extra.update(kv.split("=", 1) for kv in args.sf)
    return extra


def differences(sync: dict[str, Any], asyn: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each setting the two modes do not share: both values and why (``WHY_DIFFERENT``; a key without a reason
    there is an error, so no difference goes unstated). A key one mode leaves unset reads ``"default"``."""
    out = {}
    for key in sorted(set(sync) | set(asyn)):
        a, b = sync.get(key, "default"), asyn.get(key, "default")
        if a != b:
            if key not in WHY_DIFFERENT:
                raise SystemExit(f"bench/e2e.py: {key} differs between sync ({a}) and async ({b}) with no stated "
                                 "reason (WHY_DIFFERENT)")
            out[key] = {"sync": a, "async": b, "why": WHY_DIFFERENT[key]}
    return out


def run_streamforge(model_dir: Path, args: argparse.Namespace, out: Path, lag: int) -> dict[str, Any]:
    from streamforge.api import RLConfig, train
    from streamforge.plots import read_metrics

    run_dir = out / f"sf-lag{lag}"
    extra = mode_settings(args, lag)
    del extra["staleness.max_versions"]  # RLConfig's max_staleness sets it
    cfg = RLConfig(output_dir=str(run_dir), model=str(model_dir), learning_rate=args.lr,
                   num_generations=args.group_size, prompts_per_step=args.prompts, max_completion_length=args.max_tokens,
                   max_steps=args.max_steps, reward_target=args.target, max_staleness=lag, seed=args.seed,
                   extra=extra)
    deadline_rows: list[tuple[float, float]] = []
    result = train(cfg, reward_functions=["toy"], budget_s=args.budget_s)
    for row in read_metrics(run_dir / "metrics.jsonl"):
        deadline_rows.append((float(row["time_s"]), float(row.get("reward_mean", 0.0))))
    secs, best = time_to_target(deadline_rows, args.target, args.window)
    return {"seconds": secs, "best_reward": best, "steps": len(deadline_rows), "exit_code": result.exit_code,
            "run_dir": run_dir}


def breakdown(run_dir: Path) -> dict[str, float]:
    """Where a step's time goes, from the run's ``traces.jsonl``: medians in ms.

    Trainer side, per step: ``step_period`` (start to start), ``train`` (``trainer.step``), ``publish``
    (``trainer.publish``), ``trainer_wait`` (period minus both: waiting for a batch). Per episode, along its trace:
    ``hop_prompt`` (feeder's send to the generator's start), ``generate``, ``reward``, ``produce``,
    ``buffer_wait`` (an episode produced to the batch that holds it: its Kafka hop, its group's other samples and
    the batch filling up), ``hop_batch`` (the buffer's batch to the trainer's step on it), ``publish_to_swap``
    (the trainer's publish to a generator's swap starting) and ``swap``.
    """
    import statistics

    spans = [orjson.loads(line) for line in (run_dir / "traces.jsonl").read_bytes().splitlines() if line.strip()]
    by_id = {s["span_id"]: s for s in spans}

    def ms(ns: float) -> float:
        return ns / 1e6

    def dur(s: dict) -> float:
        return ms(s["end_time"] - s["start_time"])

    parts: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        parts.setdefault(key, []).append(value)

    steps = sorted((s for s in spans if s["name"] == "trainer.step"), key=lambda s: s["start_time"])
    publish = {s["parent_span_id"]: s for s in spans if s["name"] == "trainer.publish"}
    for a, b in itertools.pairwise(steps):
        period = ms(b["start_time"] - a["start_time"])
        pub = dur(publish[a["span_id"]]) if a["span_id"] in publish else 0.0
        add("step_period", period)
        add("trainer_wait", max(0.0, period - dur(a) - pub))
    for s in spans:
        parent = by_id.get(s["parent_span_id"] or "")
        name = s["name"]
        if name == "trainer.step":
            add("train", dur(s))
            if parent is not None:
                add("hop_batch", ms(s["start_time"] - parent["end_time"]))
        elif name == "trainer.publish":
            add("publish", dur(s))
        elif name == "generator.prompt" and parent is not None:
            add("hop_prompt", ms(s["start_time"] - parent["end_time"]))
        elif name in ("generator.generate", "generator.reward", "generator.produce"):
            add(name.split(".")[1], dur(s))
        elif name == "buffer.batch":
            for link in s["links"]:
                if (src := by_id.get(link["span_id"])) is not None:
                    add("buffer_wait", ms(s["start_time"] - src["end_time"]))
        elif name == "generator.swap":
            add("swap", dur(s))
            for link in s["links"]:
                if (src := by_id.get(link["span_id"])) is not None:
                    add("publish_to_swap", ms(s["start_time"] - src["end_time"]))
    return {k: round(statistics.median(v), 1) for k, v in parts.items() if v}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="addmod10")
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--budget-s", type=float, default=900.0, help="wall-clock budget per system")
    p.add_argument("--systems", default="trl,sync,async")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every system (the order alternating); the JSON line holds medians")
    p.add_argument("--warmstart", type=float, default=0.3, help="supervised warm-start accuracy (0 = none)")
    p.add_argument("--async-staleness", type=int, default=4, help="staleness.max_versions of the async mode")
    p.add_argument("--async-publish-every", type=int, default=3, help="trainer.publish_every of the async mode")
    p.add_argument("--async-prompts", type=int, default=24,
                   help="generator.max_concurrent_prompts of the async mode (the sync mode keeps the default, 8)")
    p.add_argument("--sf", action="append", default=[], metavar="KEY=VALUE", help="a streamforge config key")
    p.add_argument("--generator-cpus", default="last",
                   help="generator.cpus of both streamforge modes: a CPU list, 'last' (the last core this process may "
                        "use, when it may use more than one) or '' (vLLM's own binding, unpinned processes)")
    p.add_argument("--breakdown", action="store_true",
                   help="print where a streamforge step's time goes (medians from each run's traces, in ms)")
    p.add_argument("--filter-zero-variance", type=int, default=1,
                   help="streamforge (sync and async alike) drops zero-variance groups, as the demo (TRL does not)")
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.generator_cpus == "last":
        args.generator_cpus = str(cores[-1]) if len(cores) > 1 else ""
    args.loop_cpus = ",".join(map(str, cores))

    from models.tiny_model import build_tiny_model
    from models.warmstart import warm_start

    differences(mode_settings(args, 0), mode_settings(args, args.async_staleness))  # every difference stated
    out = Path(tempfile.mkdtemp(prefix="sf-bench-e2e-"))
    model_dir = build_tiny_model(out / "model", seed=args.seed)
    if args.warmstart > 0:  # the same supervised warm start as the demo, shared by all three systems
        print("warm start:", warm_start(model_dir, args.task, target_accuracy=args.warmstart, seed=args.seed))
    systems = args.systems.split(",")
    rounds: list[dict[str, dict[str, Any]]] = []
    for i in range(args.rounds):  # the order alternates round by round, so the machine's drift hits all alike
        res: dict[str, dict[str, Any]] = {}
        for name in systems if i % 2 == 0 else systems[::-1]:
            if name == "trl":
                res["trl"] = run_trl(model_dir, args, out / f"round-{i}")
            elif name in ("sync", "async"):
                lag = 0 if name == "sync" else args.async_staleness
                res[name] = run_streamforge(model_dir, args, out / f"round-{i}", lag=lag)
        for name, r in res.items():
            print(f"round {i} {name:6s} time to {args.target}: {r['seconds']} s  best running reward "
                  f"{r['best_reward']:.3f}  steps {r['steps']}", flush=True)
        rounds.append(res)
    phases = {}
    if args.breakdown:  # from the last round's runs
        for name in ("sync", "async"):
            if name in rounds[-1]:
                phases[name] = breakdown(rounds[-1][name]["run_dir"])
                print(f"{name:6s} breakdown (ms, medians):", orjson.dumps(phases[name]).decode())

    def col(name: str) -> list[float | None]:
        return [r.get(name, {}).get("seconds") for r in rounds]

    a, b, c = col("trl"), col("sync"), col("async")
    settings = {"sync": mode_settings(args, 0), "async": mode_settings(args, args.async_staleness)}
    print(orjson.dumps({
        "bench": "e2e", "task": args.task, "max_tokens": args.max_tokens, "trl_s": median(a), "sync_s": median(b),
        "async_s": median(c), "speedup_vs_trl": median([ratio(x, y) for x, y in zip(a, c)]),
        "speedup_vs_sync": median([ratio(x, y) for x, y in zip(b, c)]),
        "best_reward": {k: round(max(r[k]["best_reward"] for r in rounds if k in r), 3) for k in rounds[0]},
        "generator_cpus": args.generator_cpus, "rounds": {k: [r.get(k, {}).get("seconds") for r in rounds]
                                                           for k in rounds[0]},
        "settings": settings, "differences": differences(settings["sync"], settings["async"]),
        **({"breakdown": phases} if phases else {}),
    }).decode())


if __name__ == "__main__":
    main()
