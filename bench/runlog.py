"""Benchmark: what keeping the run's log costs the demo, against the same demo whose log lives in memory only.

Runs ``streamforge up --config configs/demo.yaml`` (as ``make demo`` does) in each of ``--modes``:
``memory`` (the baseline: Tansu ``memory://``, ``--brokers.archive=false``), ``archive`` (the default: memory plus
the run's topics copied into ``<run_dir>/log``, ``streamforge/logarchive.py``) and ``s3`` (``--brokers.durable=true``:
Tansu over SeaweedFS in ``<run_dir>/brokers``), one after the other, the order rotated each of ``--rounds`` rounds.
Per run: the wall time of ``up`` (start to exit), the run's own time to its reward target (``time_s`` of the last
metrics row) and steps, the peak resident memory of the broker processes (Tansu, nats-server, SeaweedFS) and of
every process of the run together (sampled every ``--sample-s``), and the disk the kept log takes at the end
(``log/`` and ``brokers/``). Needs Linux (``/proc``).

Last line: ``{"bench": "runlog", "wall_vs_memory": {mode: wall / memory's wall}, "train_s_vs_memory": {...},
"wall_s": {...}, "train_s": {...}, "steps": {...}, "broker_rss_mb": {...}, "total_rss_mb": {...},
"disk_mb": {...}}`` (medians over the rounds, per mode).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
BROKERS = ("tansu", "nats-server", "weed")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(pid))
    return tree


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return Path(f.read().split(b"\0", 1)[0].decode(errors="replace")).name
    except OSError:
        return ""


class Sampler(threading.Thread):
    """Peak RSS of a process tree, and of its broker processes, sampled every ``every_s``."""

    def __init__(self, root: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.root, self.every_s = root, every_s
        self.total_peak = self.broker_peak = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            tree, todo, pids = _children(), [self.root], []
            while todo:
                pid = todo.pop()
                pids.append(pid)
                todo += tree.get(pid, [])
            rss = {pid: _rss_mb(pid) for pid in pids}
            self.total_peak = max(self.total_peak, sum(rss.values()))
            self.broker_peak = max(self.broker_peak, sum(v for p, v in rss.items() if _name(p) in BROKERS))


def _du_mb(path: Path) -> float:
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_blocks * 512
    return total / 2**20


MODES = {"memory": ["--brokers.archive=false"], "archive": [], "s3": ["--brokers.durable=true"]}


def run_demo(mode: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = work / mode
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFORGE_")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    argv = [sys.executable, "-m", "streamforge", "up", "--config", "configs/demo.yaml", "--run-dir", str(run_dir),
            *MODES[mode], "--up.live=lines", *args.override]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid, args.sample_s)
    sampler.start()
    out, _ = proc.communicate(timeout=args.timeout_s)
    wall = time.monotonic() - t0
    sampler.done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"up ({mode}) failed:\n{out[-3000:]}")
    rows = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines() if line.strip()]
    audit = orjson.loads((run_dir / "audit.json").read_bytes())
    disk = sum(_du_mb(run_dir / d) for d in ("brokers", "log") if (run_dir / d).exists())
    return {"mode": mode, "wall_s": round(wall, 1), "train_s": round(rows[-1]["time_s"], 1),
            "steps": rows[-1]["step"], "broker_rss_mb": round(sampler.broker_peak, 1),
            "total_rss_mb": round(sampler.total_peak, 1), "disk_mb": round(disk, 2),
            "produced": audit.get("produced"), "lost": audit.get("lost")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", default="memory,archive", help="of memory, archive, s3 (memory is the baseline)")
    parser.add_argument("--sample-s", type=float, default=0.5)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("override", nargs="*", help="--section.key=value overrides for every run")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if "memory" not in modes or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: some of {list(MODES)}, memory included (the baseline)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="sf-bench-runlog-"))
    runs: list[dict[str, Any]] = []
    for i in range(args.rounds):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            run = run_demo(mode, work / f"round-{i}", args)
            print(orjson.dumps(run).decode(), flush=True)
            runs.append(run)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    print(orjson.dumps({
        "bench": "runlog", "rounds": args.rounds,
        "wall_vs_memory": {m: round(med(m, "wall_s") / med("memory", "wall_s"), 3) for m in modes if m != "memory"},
        "train_s_vs_memory": {m: round(med(m, "train_s") / med("memory", "train_s"), 3)
                              for m in modes if m != "memory"},
        **{key: {m: med(m, key) for m in modes}
           for key in ("wall_s", "train_s", "steps", "broker_rss_mb", "total_rss_mb", "disk_mb")},
    }).decode())


if __name__ == "__main__":
    main()
