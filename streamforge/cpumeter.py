"""CPU seconds each role of ``streamforge up`` used, read from ``/proc`` and written to ``<run_dir>/cpu.json``.

A role is its process group (``up`` starts each in a session of its own: the role, and vLLM's engine core and
worker, or torchrun's ranks). ``CpuMeter.sample(groups)`` reads ``utime + stime`` of every process in those groups
and keeps each process's latest value, so a process that exits between samples still counts up to its last sample
(``up`` samples once a second). ``write(path)`` saves ``{"roles": {name: cpu_s}, "wall_s", "cpu_s", "cores"}``:
where a run's CPU time went, beside the wall time of its steps (``metrics.jsonl``). Linux only (elsewhere it
records nothing).
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

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self._by_pid: dict[tuple[str, int], float] = {}  # (role, pid) -> latest CPU seconds seen

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

    def roles(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (role, _), cpu in self._by_pid.items():
            out[role] = out.get(role, 0.0) + cpu
        return {k: round(v, 2) for k, v in sorted(out.items())}

    def write(self, path: Path) -> dict:
        roles = self.roles()
        data = {"roles": roles, "cpu_s": round(sum(roles.values()), 2),
                "wall_s": round(time.monotonic() - self.t0, 2), "cores": len(os.sched_getaffinity(0))}
        path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
        return data
