"""``<run_dir>/reward.png``: reward, staleness and loss over time from ``<run_dir>/metrics.jsonl``.

With an evaluator (``<run_dir>/eval.jsonl``) the reward panel also shows the held-out greedy accuracy and pass@k
of each evaluated version, placed at the time the trainer reached that version's step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every row of a metrics.jsonl (none if it does not exist yet; a torn last line is skipped)."""
    from runtime.telemetry import read_jsonl

    return read_jsonl(path) if os.path.exists(path) else []


def plot_run(run_dir: str | os.PathLike) -> Path | None:
    """Write (or refresh) reward.png; returns its path, or None when there are no metrics yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        return None
    t = [r.get("time_s", i) for i, r in enumerate(rows)]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for ax, key, label in zip(axes, ("reward_mean", "staleness_mean", "loss"),
                              ("mean reward", "staleness (versions)", "loss")):
        ax.plot(t, [r.get(key, float("nan")) for r in rows], lw=1.2)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    steps = {0: t[0], **{r.get("step"): r.get("time_s") for r in rows}}  # the initial weights: training's start
    _plot_eval(axes[0], run_dir / "eval.jsonl", steps)
    axes[-1].set_xlabel("time since start (s)")
    axes[0].set_title(f"{run_dir.name}: {len(rows)} steps")
    fig.tight_layout()
    out = run_dir / "reward.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _plot_eval(ax: Any, path: Path, time_of_step: dict[Any, Any]) -> None:
    """The eval curve on the reward axis: each evaluated version at the trainer's time of its step."""
    points = [(time_of_step.get(r.get("step")), r) for r in read_metrics(path)]
    points = [(t, r) for t, r in points if t is not None]
    if not points:
        return
    t = [p[0] for p in points]
    k = points[-1][1].get("k", "k")
    ax.plot(t, [r.get("eval/accuracy", float("nan")) for _, r in points], "o-", ms=3, lw=1, label="held-out accuracy")
    ax.plot(t, [r.get("eval/pass_at_k", float("nan")) for _, r in points], "s--", ms=3, lw=1,
            label=f"held-out pass@{k}")
    ax.legend(loc="lower right", fontsize=8)
