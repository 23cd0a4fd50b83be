"""The trained-batch ledger (contract 5) and the per-step metrics file.

``<run_dir>/trainer/ledger.jsonl``: one JSON line per optimizer step, appended and flushed (fsync) after the
step: ``{"step": int, "policy_version": int, "batch_ids": [str], "episode_ids": [str], "time": float}``. On restart
from a checkpoint at step ``s`` the trainer first rewrites the ledger without the lines of step > ``s`` (those steps
are trained again, from the same offsets), so across crashes the ledger's batch ids never repeat and none is skipped.

``TrainedEpisodes`` remembers the episode ids of the last ``window`` steps (rebuilt from the ledger on restart, so
it always matches the weights being trained): a batch holding an episode already trained is refused (a zombie
buffer's batch, see ``buffer/service.py``), whatever its batch id.

``<run_dir>/metrics.jsonl``: one JSON line per step with at least ``step, policy_version, time_s, reward_mean,
loss, staleness_mean, episodes`` (plus kl, entropy, clip_fraction, grad_norm, tokens_per_s, lr...).
"""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path
from typing import Any

import orjson

ALREADY_TRAINED = "already_trained"  # dead-letter reason of a batch refused by ``TrainedEpisodes``
STALE = "stale"  # dead-letter reason of a batch too stale to train when its turn came (streamforge/staleness.py)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            break  # a torn last line from a crash mid-write: everything after it is gone too
    return out


class JsonlAppender:
    """Append-only JSON lines, flushed and fsynced per line (a line is durable once ``append`` returns)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab")  # noqa: SIM115 - held open for the role's lifetime, closed by close()

    def append(self, row: dict[str, Any]) -> None:
        self._fh.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


class Ledger(JsonlAppender):
    """``<run_dir>/trainer/ledger.jsonl`` (see the module docstring)."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(Path(run_dir) / "trainer" / "ledger.jsonl")

    def record(self, *, step: int, policy_version: int, batch_ids: list[str],
               episode_ids: list[str] | None = None) -> None:
        row: dict[str, Any] = {"step": step, "policy_version": policy_version, "batch_ids": list(batch_ids)}
        if episode_ids is not None:
            row["episode_ids"] = list(episode_ids)
        row["time"] = time.time()
        self.append(row)

    @staticmethod
    def read(run_dir: str | Path) -> list[dict[str, Any]]:
        return _read_lines(Path(run_dir) / "trainer" / "ledger.jsonl")

    @staticmethod
    def truncate_after(run_dir: str | Path, step: int) -> int:
        """Rewrite the ledger (atomically) without lines of step > ``step``; returns how many were removed."""
        path = Path(run_dir) / "trainer" / "ledger.jsonl"
        rows = _read_lines(path)
        keep = [r for r in rows if int(r["step"]) <= step]
        if not path.exists():
            return 0
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in keep))
        os.replace(tmp, path)
        return len(rows) - len(keep)


class TrainedEpisodes:
    """The episode ids trained in the last ``window`` steps (see the module docstring)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._step_of: dict[str, int] = {}
        self._steps: collections.deque[tuple[int, list[str]]] = collections.deque()

    def __len__(self) -> int:
        return len(self._step_of)

    def add(self, step: int, episode_ids: list[str]) -> None:
        ids = list(episode_ids)
        self._steps.append((step, ids))
        for eid in ids:
            self._step_of[eid] = step
        while len(self._steps) > self.window:
            old_step, old_ids = self._steps.popleft()
            for eid in old_ids:
                if self._step_of.get(eid) == old_step:
                    del self._step_of[eid]

    def trained(self, episode_ids: list[str]) -> dict[str, int]:
        """Those of ``episode_ids`` already trained, with the step that trained each."""
        return {e: self._step_of[e] for e in episode_ids if e in self._step_of}

    def load(self, rows: list[dict[str, Any]]) -> None:
        """Rebuild from ledger lines (older lines without ``episode_ids`` contribute nothing)."""
        for row in rows[-self.window:]:
            self.add(int(row["step"]), row.get("episode_ids") or [])


def truncate_metrics_after(path: str | Path, step: int) -> None:
    """Drop metric rows of steps > ``step`` (re-trained after a restart), keeping the file a function of step."""
    path = Path(path)
    if not path.exists():
        return
    keep = [r for r in _read_lines(path) if int(r.get("step", 0)) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in keep))
    os.replace(tmp, path)
