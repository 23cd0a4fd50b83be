"""CPU seconds each role of ``streamforge up`` used, read from ``/proc`` and written to ``<run_dir>/cpu.json``.

A role is its process group (``up`` starts each in a session of its own: the role, and vLLM's engine core and
worker, or torchrun's ranks). ``CpuMeter.sample(groups)`` reads ``utime + stime`` of every process in those groups
and keeps each process's latest value, so a process that exits between samples still counts up to its last sample
(``up`` samples once a second). ``write(path)`` saves ``{"roles": {name: cpu_s}, "wall_s", "cpu_s", "cores",
"series"}``: where a run's CPU time went, beside the wall time of its steps (``metrics.jsonl``). ``series`` holds
``[epoch seconds, {name: cpu_s}]`` readings every ``series_every_s`` (at most ``max_series`` of them: past that
every other one is dropped and the spacing doubles), so a reader can take the CPU of any stretch of the run, e.g.
per trainer step once it runs steadily (``bench/realmodel.py``). ``own`` names this process's own CPU (``up``'s
loop) among the roles. Linux only (elsewhere it records nothing).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import orjson

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: str) -> tuple[int, float] | None:
    """(process group, CPU seconds) of one process from ``/proc/<pid>/stat``; None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()  # after "pid (comm) ": state is field 0 here
    return int(fields[2]), (int(fields[11]) + int(fields[12])) / _TICK  # pgrp; utime + stime


class CpuMeter:
    """Per-role CPU seconds from periodic samples of ``/proc``; see the module docstring."""

    def __init__(self, *, own: str | None = None, series_every_s: float = 2.0, max_series: int = 2048) -> None:
        self.t0 = time.monotonic()
        self._by_pid: dict[tuple[str, int], float] = {}  # (role, pid) -> latest CPU seconds seen
        self.own = own
        self.series: list[list] = []  # [epoch seconds, roles()] readings, see the module docstring
        self.series_every_s = series_every_s
        self.max_series = max(2, max_series)
        self._series_at = float("-inf")

    def sample(self, groups: dict[str, int]) -> None:
        """One reading of every process whose group id is one of ``groups`` (role name -> process group id)."""
        if not os.path.isdir("/proc"):
            return
        role_of = {pgid: name for name, pgid in groups.items()}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            st = _stat(pid)
            if st is not None and st[0] in role_of:
                self._by_pid[(role_of[st[0]], int(pid))] = st[1]
        if self.own:
            self._by_pid[(self.own, os.getpid())] = time.process_time()
        now = time.monotonic()
        if now - self._series_at >= self.series_every_s:
            self._series_at = now
            self.series.append([round(time.time(), 2), self.roles()])
            if len(self.series) > self.max_series:
                self.series = self.series[::2]
                self.series_every_s *= 2

    def roles(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (role, _), cpu in self._by_pid.items():
            out[role] = out.get(role, 0.0) + cpu
        return {k: round(v, 2) for k, v in sorted(out.items())}

    def write(self, path: Path) -> dict:
        roles = self.roles()
        data = {"roles": roles, "cpu_s": round(sum(roles.values()), 2),
                "wall_s": round(time.monotonic() - self.t0, 2), "cores": len(os.sched_getaffinity(0)),
                "series": self.series}
        path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
        return data
