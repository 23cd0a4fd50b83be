"""What ``streamforge up`` shows while a run goes: a rich live table on a terminal, progress lines otherwise.

Everything comes from what the roles already write, so the view costs the run nothing:

* the trainer's last ``<run_dir>/metrics.jsonl`` row: step, policy version, reward, loss, staleness, tokens/s and
  the buffers' drop counters;
* each generator's last ``<run_dir>/metrics-generator*.jsonl`` row: its loaded policy version, tokens/s, episodes;
* consumer lag per topic (records not yet committed by the consuming group), read from Kafka by ``up`` every few
  seconds in the background (``Lag``), never on the path of the table refresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("streamforge.progress")

TAIL_BYTES = 16384  # the last row of a metrics file is within this many bytes of its end


def last_row(path: Path) -> dict[str, Any] | None:
    """The last complete JSON line of a JSONL file (None when there is none yet)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - TAIL_BYTES))
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line being written, or the cut first line of the tail
        if isinstance(row, dict):
            return row
    return None


@dataclass
class Snapshot:
    trainer: dict[str, Any] | None = None
    generators: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> last metrics row
    lag: dict[str, int] = field(default_factory=dict)  # topic -> records not committed by its group

    @property
    def step(self) -> int:
        return int(self.trainer.get("step", 0)) if self.trainer else 0


def read_snapshot(run_dir: Path, lag: dict[str, int] | None = None) -> Snapshot:
    gens = {}
    for path in sorted(run_dir.glob("metrics-generator*.jsonl")):
        row = last_row(path)
        if row is not None:
            gens[path.stem.removeprefix("metrics-")] = row
    return Snapshot(trainer=last_row(run_dir / "metrics.jsonl"), generators=gens, lag=dict(lag or {}))


def _drops(row: dict[str, Any]) -> str:
    parts = [f"{k.removeprefix('buffer/dropped/')} {v:.0f}" for k, v in sorted(row.items())
             if k.startswith("buffer/dropped/") and v]
    return ", ".join(parts) or "none"


def progress_line(s: Snapshot) -> str:
    """One line for logs and pipes (no terminal)."""
    t = s.trainer or {}
    text = (f"step {t.get('step')}  version {t.get('policy_version')}  reward {t.get('reward_mean', 0):.3f}  "
            f"loss {t.get('loss', 0):.4f}  staleness {t.get('staleness_mean', 0):.2f}  "
            f"t {t.get('time_s', 0):.0f}s")
    if s.generators:
        text += "  generators " + " ".join(
            f"{g}@v{r.get('generator/policy_version', 0):.0f}" for g, r in s.generators.items())
    if s.lag:
        text += "  lag " + " ".join(f"{topic.rsplit('.', 1)[-1]}={n}" for topic, n in s.lag.items())
    return text


def progress_table(s: Snapshot) -> Any:
    """A rich renderable: the trainer's state, one row per generator, and consumer lag per topic."""
    from rich.console import Group
    from rich.table import Table

    t = s.trainer or {}
    head = Table(title="streamforge up", show_header=True, expand=False)
    for col in ("step", "version", "reward", "loss", "staleness", "train tok/s", "elapsed", "dropped"):
        head.add_column(col, justify="right")
    if t:
        head.add_row(str(t.get("step")), str(t.get("policy_version")), f"{t.get('reward_mean', 0):.3f}",
                     f"{t.get('loss', 0):.4f}", f"{t.get('staleness_mean', 0):.2f}",
                     f"{t.get('tokens_per_s', 0):.0f}", f"{t.get('time_s', 0):.0f}s", _drops(t))
    else:
        head.add_row("-", "-", "-", "-", "-", "-", "-", "waiting for the first step")
    gens = Table(show_header=True, expand=False)
    for col in ("generator", "version", "tok/s", "episodes", "swaps", "reward"):
        gens.add_column(col, justify="right")
    for g, r in s.generators.items():
        gens.add_row(g, f"{r.get('generator/policy_version', 0):.0f}", f"{r.get('generator/tokens_per_s', 0):.0f}",
                     f"{r.get('generator/episodes', 0):.0f}", f"{r.get('generator/swaps', 0):.0f}",
                     f"{r['generator/reward_mean']:.3f}" if "generator/reward_mean" in r else "-")
    parts: list[Any] = [head, gens]
    if s.lag:
        lag = Table(show_header=True, expand=False)
        for topic in s.lag:
            lag.add_column(f"lag {topic.rsplit('.', 1)[-1]}", justify="right")
        lag.add_row(*(str(n) for n in s.lag.values()))
        parts.append(lag)
    return Group(*parts)


class Lag:
    """Consumer lag per topic, refreshed in the background every ``every_s`` (errors keep the last value)."""

    def __init__(self, config: Any, every_s: float = 5.0) -> None:
        self.config = config
        self.every_s = every_s
        self.value: dict[str, int] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                self.value = await read_lag(self.config)
            except Exception as exc:  # noqa: BLE001 - the view must never stop the run
                log.debug("consumer lag not available: %s", exc)
            await asyncio.sleep(max(0.5, self.every_s - (time.monotonic() - t0)))


async def read_lag(config: Any) -> dict[str, int]:
    """Records each consuming group has not committed yet, per topic (prompts, episodes, batches)."""
    from topics.admin import group_lag

    groups = config.names.consumer_groups()
    return {topic: await group_lag(config.kafka, group, topic) for topic, group in groups.items()}
