"""The live view of ``streamforge up``: snapshot from the run directory, one progress line, the rich table."""

from __future__ import annotations

from pathlib import Path

import orjson
from rich.console import Console

from streamforge.progress import Snapshot, last_row, progress_line, progress_table, read_snapshot


def write_rows(path: Path, rows: list[dict], tail: bytes = b"") -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows) + tail)


def test_last_row_skips_a_line_being_written(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    assert last_row(path) is None
    write_rows(path, [{"step": 1}, {"step": 2}], tail=b'{"step": 3, "rew')
    assert last_row(path) == {"step": 2}
    path.write_bytes(b"x" * 40000 + b"\n" + orjson.dumps({"step": 9}) + b"\n")  # only the tail is read
    assert last_row(path) == {"step": 9}


def make_run(tmp_path: Path) -> Path:
    write_rows(tmp_path / "metrics.jsonl", [
        {"step": 1, "policy_version": 0, "reward_mean": 0.1, "loss": 0.5, "staleness_mean": 1.0, "time_s": 3.0},
        {"step": 2, "policy_version": 1, "reward_mean": 0.625, "loss": -0.0123, "staleness_mean": 0.5,
         "time_s": 7.4, "tokens_per_s": 1234.0, "buffer/dropped/stale": 16.0, "buffer/dropped/late": 0.0},
    ])
    write_rows(tmp_path / "metrics-generator-0.jsonl", [
        {"step": 1, "generator/policy_version": 1.0, "generator/tokens_per_s": 321.0, "generator/episodes": 96.0,
         "generator/swaps": 1.0, "generator/reward_mean": 0.5}])
    write_rows(tmp_path / "metrics-generator-1.jsonl", [
        {"step": 1, "generator/policy_version": 0.0, "generator/tokens_per_s": 300.0, "generator/episodes": 80.0,
         "generator/swaps": 0.0}])
    write_rows(tmp_path / "metrics-buffer-0.jsonl", [{"step": 1, "buffer/batches": 3.0}])
    return tmp_path


def test_snapshot_and_line(tmp_path: Path) -> None:
    snap = read_snapshot(make_run(tmp_path), {"demo.prompts": 4, "demo.episodes": 0, "demo.batches": 1})
    assert snap.step == 2 and set(snap.generators) == {"generator-0", "generator-1"}
    line = progress_line(snap)
    assert line.startswith("step 2  version 1  reward 0.625  loss -0.0123  staleness 0.50  t 7s")
    assert "generators generator-0@v1 generator-1@v0" in line
    assert line.endswith("lag prompts=4 episodes=0 batches=1")


def test_table_shows_trainer_generators_drops_and_lag(tmp_path: Path) -> None:
    snap = read_snapshot(make_run(tmp_path), {"demo.prompts": 4, "demo.episodes": 0, "demo.batches": 1})
    console = Console(record=True, width=160, color_system=None)
    console.print(progress_table(snap))
    text = console.export_text()
    assert "0.625" in text and "-0.0123" in text and "1234" in text and "stale 16" in text
    assert "late" not in text  # zero counters are left out
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "generator-" in line}
    assert set(rows) == {"generator-0", "generator-1"} and "321" in rows["generator-0"]
    assert "lag prompts" in text and "lag batches" in text


def test_table_before_the_first_step() -> None:
    console = Console(record=True, width=160, color_system=None)
    console.print(progress_table(Snapshot()))
    assert "waiting for the first step" in console.export_text()


async def test_view_in_table_mode_and_line_mode(tmp_path: Path, capsys) -> None:
    import dataclasses

    from streamforge.config import RunConfig, UpConfig
    from streamforge.up import ProgressView

    run = make_run(tmp_path)
    base = RunConfig()
    base = dataclasses.replace(base, run=dataclasses.replace(base.run, run_dir=str(run)))
    table = ProgressView(dataclasses.replace(base, up=UpConfig(live="table", lag_every_s=0)))
    table.start()
    table.refresh()
    await table.stop()
    out = capsys.readouterr().out
    assert "0.625" in out and "generator-1" in out and "step 2" not in out

    lines = ProgressView(dataclasses.replace(base, up=UpConfig(live="lines", lag_every_s=0)))
    lines.start()
    lines.refresh()
    lines.refresh()  # no new step: no new line
    await lines.stop()
    assert capsys.readouterr().out.splitlines() == [progress_line(read_snapshot(run))]
