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


def test_the_series_keeps_readings_over_time_and_thins_itself(tmp_path) -> None:
    """``series`` lets a reader take the CPU of a stretch of the run; past ``max_series`` readings it keeps every
    other one and doubles its spacing, so a long run's file stays small. ``own`` is this process's CPU."""
    meter = CpuMeter(own="up", series_every_s=0.0, max_series=4)
    proc = subprocess.Popen([sys.executable, "-c", BUSY.format(s=0.3)], start_new_session=True)
    for _ in range(5):
        meter.sample({"busy": proc.pid})
        time.sleep(0.02)
    proc.wait()
    meter.sample({"busy": proc.pid})
    assert len(meter.series) <= 4 and meter.series_every_s == 0.0  # 0 doubled stays 0: thinned at every overflow
    times = [t for t, _ in meter.series]
    assert times == sorted(times)
    assert meter.series[-1][1]["up"] > 0 and meter.series[-1][1]["busy"] >= meter.series[0][1].get("busy", 0.0)
    data = meter.write(tmp_path / "cpu.json")
    assert data["series"] == meter.series and data["roles"]["up"] > 0
    spaced = CpuMeter(series_every_s=1.0, max_series=2)
    for _ in range(3):
        spaced.sample({})
    assert len(spaced.series) == 1  # one reading a second at most
