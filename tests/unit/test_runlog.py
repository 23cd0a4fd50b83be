"""Reopening a finished run without starting a broker: who serves a broker directory, runs that cannot be
reopened (they kept no log, or there is no config), and the archive's file format."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import msgpack
import pytest

from streamforge.brokers import ENDPOINTS_FILE, LOCK_FILE, serving
from streamforge.config import dump_config, load_config
from streamforge.logarchive import archived_end, iter_partition
from streamforge.runlog import RunLogUnavailable, reopen, run_config


def test_serving_reads_the_endpoints_only_while_their_owner_holds_the_lock(tmp_path: Path) -> None:
    assert serving(tmp_path) is None
    endpoints = {"kafka_bootstrap": "127.0.0.1:1", "nats_url": "nats://127.0.0.1:2", "pid": 1}
    (tmp_path / ENDPOINTS_FILE).write_text(json.dumps(endpoints))
    with open(tmp_path / LOCK_FILE, "a+b") as owner:
        assert serving(tmp_path) is None  # a file left by an owner that died: nobody holds the lock
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert serving(tmp_path) == endpoints
    assert serving(tmp_path) is None


def _run_dir(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(load_config(None, list(overrides), environ={})))
    return run_dir


async def test_a_run_that_kept_no_log_cannot_be_reopened(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "--brokers.archive=false")
    config = run_config(run_dir)
    assert config.run_dir == run_dir and not config.brokers.archive
    with pytest.raises(RunLogUnavailable, match="not kept"):
        async with reopen(config):
            pass
    with pytest.raises(RunLogUnavailable, match="not kept"):  # the default keeps an archive: none is there
        async with reopen(run_config(_run_dir(tmp_path / "other"))):
            pass
    with pytest.raises(RunLogUnavailable, match="config.yaml"):
        run_config(tmp_path / "elsewhere")


def test_an_archived_partition_reads_back_to_its_last_whole_record(tmp_path: Path) -> None:
    path = tmp_path / "0.msgpack"
    records = [{"o": i, "k": f"k{i}".encode(), "v": bytes([i]) * 3, "h": [["traceparent", b"x"]], "t": 1000 + i}
               for i in range(3)]
    whole = b"".join(msgpack.packb(r, use_bin_type=True) for r in records)
    path.write_bytes(whole + msgpack.packb({"o": 3, "k": None, "v": b"torn"}, use_bin_type=True)[:-2])
    assert list(iter_partition(path)) == records
    assert archived_end(path) == (3, len(whole))


async def test_a_run_on_external_brokers_is_reopened_as_it_is(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "--kafka.bootstrap=kafka:9092", "--nats.url=nats://nats:4222")
    async with reopen(run_config(run_dir)) as config:
        assert (config.kafka.bootstrap, config.nats.url) == ("kafka:9092", "nats://nats:4222")
