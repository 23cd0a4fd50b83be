"""``<run_dir>/reward.png``: reward, staleness and loss over time from ``<run_dir>/metrics.jsonl``."""

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
    axes[-1].set_xlabel("time since start (s)")
    axes[0].set_title(f"{run_dir.name}: {len(rows)} steps")
    fig.tight_layout()
    out = run_dir / "reward.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
