"""``bench/realmodel.py``'s reading: time to target per run, per-seed ratios and their medians (a miss counts)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_realmodel():
    spec = importlib.util.spec_from_file_location("bench_realmodel", ROOT / "bench" / "realmodel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_time_to_target_needs_a_full_window_and_counts_from_the_first_step() -> None:
    rm = load_realmodel()
    rows = [(100.0 + 10 * i, r) for i, r in enumerate([0.9, 0.1, 0.5, 0.7, 0.8])]
    # the first step alone reads 0.9, but a window of 3 must be full: steps 3-5 average 0.667
    first, wall, best = rm.time_to_target(rows, 0.6, 3, 90.0)
    assert first == 40.0 and wall == 50.0 and best == pytest.approx(2 / 3)  # the running mean at the hit
    assert rm.time_to_target(rows, 0.95, 3, 90.0)[:2] == (None, None)


def test_a_missed_target_is_infinitely_slow_in_the_medians() -> None:
    rm = load_realmodel()
    assert rm.ratio(120.0, 80.0) == 1.5
    assert rm.ratio(None, 80.0) == math.inf and rm.ratio(120.0, None) == 0.0 and rm.ratio(None, None) is None
    # seeds: async won 1.5x, missed its target, and won 1.2x: the median is 1.2, not the mean of the two it reached
    assert rm.median([rm.ratio(120.0, 80.0), rm.ratio(90.0, None), rm.ratio(96.0, 80.0)]) == pytest.approx(1.2)
    # two misses of three: the median time is a miss (None), as is a run where nothing was measured
    assert rm.median([math.inf, math.inf, 10.0]) is None and rm.median([None, None]) is None
    assert rm.median([None, 3.0, 5.0]) == 4.0


def test_a_read_run_keeps_its_metrics_and_drops_its_weights(tmp_path: Path) -> None:
    rm = load_realmodel()
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)
    (tmp_path / "logs").mkdir()
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n' * 100)
    (tmp_path / "logs" / "trainer.log").write_text("ok\n")
    (tmp_path / "checkpoints" / "step-3" / "model.pt").write_bytes(b"\0" * 2048)
    rm.drop_heavy_files(tmp_path, limit=1500)
    assert not (tmp_path / "checkpoints" / "step-3" / "model.pt").exists()
    assert (tmp_path / "metrics.jsonl").stat().st_size == 1200 and (tmp_path / "logs" / "trainer.log").exists()


def test_trl_mixed_precision_is_tried_first_only_on_a_cpu_with_amx() -> None:
    rm = load_realmodel()
    assert rm.default_trl_configs({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}).split(",") == [
        "async", "vllm-colocate", "vllm-server", "transformers-bf16", "transformers"]
    # avx512_bf16 alone (the AMD EPYC): TRL's bf16=True was slower than its fp32 there
    assert rm.default_trl_configs({"avx512f", "avx512_bf16"}).split(",") == [
        "async", "vllm-colocate", "vllm-server", "transformers"]
    # a host with jemalloc (streamforge's roles run under it there): TRL's fastest local configuration under it first
    assert rm.default_trl_configs({"amx_bf16"}, jemalloc=True).split(",") == [
        "async", "vllm-colocate", "vllm-server", "transformers-bf16+jemalloc", "transformers-bf16", "transformers"]
    assert rm.default_trl_configs(set(), jemalloc=True).split(",") == [
        "async", "vllm-colocate", "vllm-server", "transformers+jemalloc", "transformers"]
    assert isinstance(rm.cpu_flags(), set)


def test_steady_state_reads_cpu_per_step_from_the_runs_series(tmp_path: Path) -> None:
    """From the third step on: the median period, each role's CPU seconds per step and the cores' busy share."""
    import orjson

    rm = load_realmodel()
    series = [[100.0 + 2 * i, {"trainer": 3.0 * i, "generator-0": 2.0 * i, "feeder": 0.0}] for i in range(30)]
    (tmp_path / "cpu.json").write_bytes(orjson.dumps({"cores": 2, "series": series}))
    times = [100.0 + 5 * i for i in range(10)]
    got = rm.steady_state(tmp_path, times)
    assert got["period_s"] == 5.0
    assert got["cpu_per_step"] == {"trainer": 7.5, "generator-0": 5.0}  # 1.5 and 1 cores over 5 s; idle roles left out
    assert got["cores_busy"] == 1.25
    assert rm.steady_state(tmp_path, times[:4]) == {}  # too few steps to read
    (tmp_path / "cpu.json").write_bytes(orjson.dumps({"cores": 2, "roles": {}}))  # a cpu.json from before the series
    assert rm.steady_state(tmp_path, times) == {}


def test_scoring_seeds_are_not_the_tuning_seeds() -> None:
    rm = load_realmodel()
    assert not set(rm.SCORING_SEEDS) & set(rm.TUNING_SEEDS)


def test_a_trl_configuration_that_failed_is_not_tried_again_and_keeps_its_reason(tmp_path: Path, monkeypatch) -> None:
    """Seed after seed, a configuration that failed before its first step is reported with its reason, not re-run."""
    import argparse
    import subprocess

    import orjson

    rm = load_realmodel()
    calls: list[str] = []

    def fake_run(cmd, **kw):
        name = cmd[cmd.index("--trl-configs") + 1]
        calls.append(name)
        out = Path(cmd[cmd.index("--out") + 1])
        if name == "vllm-server":
            stdout = orjson.dumps({"trl_config": None, "tried": ["vllm-server: NotImplementedError: needs CUDA"]})
            return subprocess.CompletedProcess(cmd, 0, stdout.decode() + "\n", "")
        (out / "trl.jsonl").write_bytes(orjson.dumps({"time": 1.0, "step": 1, "reward": 0.5}) + b"\n")
        return subprocess.CompletedProcess(cmd, 0, orjson.dumps({"trl_config": name, "tried": []}).decode() + "\n", "")

    monkeypatch.setattr(rm.subprocess, "run", fake_run)
    args = argparse.Namespace(trl_configs="vllm-server,transformers", config="c", budget_s=1.0, target=0.6, trl_python="",
                              window=1, seed=21)
    first = rm.run_trl(args, tmp_path)
    second = rm.run_trl(args, tmp_path)
    assert calls == ["vllm-server", "transformers", "transformers"]
    assert first["trl_config"] == second["trl_config"] == "transformers"
    assert first["tried"] == ["vllm-server: NotImplementedError: needs CUDA"]
    assert second["tried"] == ["vllm-server: NotImplementedError: needs CUDA (earlier seed; not tried again)"]
