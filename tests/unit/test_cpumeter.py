"""``CpuMeter``: CPU seconds per role from /proc, counting processes that exit between samples."""

from __future__ import annotations

import subprocess
import sys
import time

import orjson

from streamforge.cpumeter import CpuMeter

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_cpu_of_a_process_group_is_counted_after_its_process_exits(tmp_path) -> None:
    meter = CpuMeter()
    proc = subprocess.Popen([sys.executable, "-c", BUSY.format(s=0.4)], start_new_session=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"], start_new_session=True)
    groups = {"busy": proc.pid, "idle": idle.pid}
    deadline = time.monotonic() + 20
    while proc.poll() is None and time.monotonic() < deadline:
        meter.sample(groups)
        time.sleep(0.05)
    meter.sample(groups)  # the busy process is gone now: its last reading stands
    idle.wait()
    roles = meter.roles()
    assert roles["busy"] >= 0.3
    assert roles.get("idle", 0.0) < roles["busy"]
    data = meter.write(tmp_path / "cpu.json")
    assert orjson.loads((tmp_path / "cpu.json").read_bytes()) == data
    assert data["cpu_s"] >= roles["busy"] and data["cores"] >= 1 and data["wall_s"] > 0
