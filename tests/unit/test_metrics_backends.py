"""The metrics backends with their real libraries: TensorBoard (the event file read back) and W&B offline."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from runtime.metrics import MetricsLogger


def test_tensorboard_writes_an_event_file_that_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = MetricsLogger("trainer", tmp_path, ["tensorboard"])
    for step in (1, 2, 3):
        m.record("trainer/loss", 1.0 / step)
        m.record("trainer/loss", 3.0 / step)
        m.flush(step)
    m.close()
    m.close()  # twice is fine
    events = EventAccumulator(str(tmp_path / "tb" / "trainer"))
    events.Reload()
    scalars = events.Scalars("trainer/loss")
    assert [s.step for s in scalars] == [1, 2, 3]
    assert [round(s.value, 4) for s in scalars] == [2.0, 1.0, round(2 / 3, 4)]  # the mean of each flush


def test_wandb_offline_run_is_initialised_logged_and_finished(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = tmp_path / "myrun"
    m = MetricsLogger("generator-0", run_dir, ["wandb"], wandb_project="sf-test",
                      run_config={"trainer": {"lr": 0.001}})
    for step in (1, 2):
        m.record("generator/tokens_per_s", 100.0 * step)
        m.flush(step)
    m.close()
    logs = list((run_dir / "wandb").glob("offline-run-*/*.wandb"))  # the run's log, for `wandb sync` later
    assert len(logs) == 1, list((run_dir / "wandb").iterdir())
    # wandb's own service process writes the log: under load its last records can land just after finish() returns
    deadline = time.monotonic() + 30
    while True:
        records = wandb_records(logs[0])
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds:
            break
        assert time.monotonic() < deadline, f"no exit record in the run's log after 30 s: {kinds}"
        time.sleep(0.2)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.run_group, run.display_name) == ("sf-test", "myrun", "generator-0")
    assert any(u.key == "trainer" and "0.001" in u.value_json for u in run.config.update)
    history = [{(i.key or "/".join(i.nested_key)): i.value_json for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], float(h["generator/tokens_per_s"])) for h in history] == [("1", 100.0), ("2", 200.0)]
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run log: a 7-byte header, then LevelDB-log framed records (32 KiB blocks;
    each chunk: crc32c (4), length (2, little-endian), type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, part, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        part += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def test_a_missing_backend_package_is_skipped_with_a_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    m = MetricsLogger("buffer", tmp_path, ["wandb", "jsonl"])
    m.record("buffer/held", 3)
    assert m.flush(1) == {"buffer/held": 3.0}
    assert "wandb is not installed" in caplog.text
    assert (tmp_path / "metrics-buffer.jsonl").exists()
