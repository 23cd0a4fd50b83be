"""Learning under a forced lag of 4 versions: decoupled PPO against the naive GRPO objective (AReaL's claim).

Every batch is sampled by weights exactly ``--lag`` versions behind the trainer (``tests/helpers/lagged.py``: the
trainer publishes after every batch, the sampler holds the weights of ``version - lag``), on the demo's task and
target: ``addmod10`` from the demo's warm start (the tiny model, supervised to 30% greedy accuracy), 8 prompts x 8
samples a batch, stop when the running mean reward over 20 batches reaches 0.8 (``--target``) or after
``--max-steps`` batches. The trainer is ``TrainEngine`` (the trainer role's step) with ``--minibatches`` optimizer
steps per batch for every arm, so the arms differ only in the objective:

* ``decoupled_ppo``: the clip anchored at the proximal policy (the weights before the batch's first update), the
  behaviour policy only in a truncated importance weight;
* ``grpo``: TRL's GRPO objective, whose ratio and clip are anchored at the behaviour policy, ``lag`` versions old;
* ``grpo_1step`` (``--with-one-step``): GRPO with one step per batch (the default trainer), for reference.

Each arm runs ``--seeds`` seeds (seed = the prompts, the sampling and the torch seed; the warm start is shared).
Last line: ``{"bench": "lag", "lag": 4, "target": 0.8, "decoupled_ppo_steps": median, "grpo_steps": median,
"steps_ratio": grpo / decoupled_ppo, "reached": {...}, "runs": [...]}``, a run that does not reach the target
counting as ``--max-steps``. ``--curves FILE`` writes every run's running-mean curve (JSON).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # helpers.lagged, helpers.toybatches

ARMS = {"decoupled_ppo": ("decoupled_ppo", None), "grpo": ("grpo", None), "grpo_1step": ("grpo", 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lag", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the tiny model gains nothing from more)")
    ap.add_argument("--with-one-step", action="store_true", help="also GRPO with one optimizer step per batch")
    ap.add_argument("--curves", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from helpers.lagged import run_lagged
    from models.tiny_model import build_tiny_model
    from models.warmstart import warm_start

    torch.set_num_threads(args.threads)
    arms = ["decoupled_ppo", "grpo"] + (["grpo_1step"] if args.with_one_step else [])
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        ws = warm_start(model_dir, "addmod10", target_accuracy=0.3, seed=0)
        print(f"warm start: {ws}", flush=True)
        for seed in range(args.seeds):
            for arm in arms:  # alternated per seed
                loss, mb = ARMS[arm]
                r = run_lagged(model_dir, Path(tmp) / f"{arm}-{seed}", loss=loss, lag=args.lag, target=args.target,
                               max_steps=args.max_steps, lr=args.lr, minibatches=mb or args.minibatches, seed=seed)
                runs.append({"arm": arm, "seed": seed, "steps": r.steps, "reached": r.reached,
                             "train_s": round(r.train_s, 1), "wall_s": round(r.wall_s, 1),
                             "final": round(r.curve[-1], 3),
                             "clip_fraction_mean": round(statistics.fmean(r.clip_fraction), 4),
                             "curve": [round(x, 3) for x in r.curve]})
                print(f"{arm} seed {seed}: {r.steps} steps, reached {r.reached}, final {r.curve[-1]:.3f}, "
                      f"curve every 25: {[round(x, 2) for x in r.curve[::25]]}, {r.wall_s:.0f} s", flush=True)
    if args.curves:
        args.curves.write_bytes(orjson.dumps(runs))

    def steps(arm: str) -> float:
        return statistics.median(x["steps"] if x["reached"] else args.max_steps for x in runs if x["arm"] == arm)

    out = {"bench": "lag", "lag": args.lag, "target": args.target, "max_steps": args.max_steps,
           "minibatches": args.minibatches, "lr": args.lr, "seeds": args.seeds,
           **{f"{arm}_steps": steps(arm) for arm in arms},
           "steps_ratio": round(steps("grpo") / steps("decoupled_ppo"), 3),
           "reached": {arm: sum(x["reached"] for x in runs if x["arm"] == arm) for arm in arms},
           "runs": [{k: v for k, v in x.items() if k != "curve"} for x in runs]}
    print(orjson.dumps(out).decode())


if __name__ == "__main__":
    main()
