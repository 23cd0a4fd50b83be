"""``bench/e2e.py``: a step's phases read from a run's traces (hand-made spans, known durations), and the settings
that differ between its sync and async modes, each stated."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
MS = 1_000_000


def load_e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "bench" / "e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def span(sid: str, name: str, start_ms: float, end_ms: float, parent: str | None = None,
         links: tuple[str, ...] = ()) -> dict:
    return {"trace_id": "t", "span_id": sid, "parent_span_id": parent, "name": name, "start_time": int(start_ms * MS),
            "end_time": int(end_ms * MS), "attributes": {}, "links": [{"trace_id": "t", "span_id": x} for x in links],
            "service": name.split(".")[0], "status": "UNSET"}


def test_breakdown_reads_each_phase_from_the_spans(tmp_path: Path) -> None:
    spans = [
        span("f", "feeder.prompt", 0, 1),
        span("g", "generator.prompt", 3, 60, parent="f"),  # 2 ms on the prompts topic
        span("gen", "generator.generate", 3, 50, parent="g"),
        span("r", "generator.reward", 50, 55, parent="g"),
        span("p", "generator.produce", 55, 56, parent="g"),
        span("b", "buffer.batch", 66, 67, links=("p",)),  # 10 ms from produced to batched
        span("s1", "trainer.step", 70, 100, parent="b"),  # 3 ms from the batch to the step
        span("pub", "trainer.publish", 100, 104, parent="s1"),
        span("s2", "trainer.step", 120, 150, parent="b"),
        span("sw", "generator.swap", 110, 118, links=("pub",)),
    ]
    (tmp_path / "traces.jsonl").write_bytes(b"".join(orjson.dumps(s) + b"\n" for s in spans))
    phases = load_e2e().breakdown(tmp_path)
    assert phases["hop_prompt"] == 2.0 and phases["generate"] == 47.0 and phases["reward"] == 5.0
    assert phases["buffer_wait"] == 10.0 and phases["hop_batch"] == 28.0  # median of 3 and 53 ms
    assert phases["step_period"] == 50.0 and phases["train"] == 30.0 and phases["publish"] == 4.0
    assert phases["trainer_wait"] == 16.0  # 50 - 30 - 4
    assert phases["publish_to_swap"] == 6.0 and phases["swap"] == 8.0


def test_every_setting_that_differs_between_sync_and_async_is_stated_with_its_reason() -> None:
    import argparse

    import pytest

    e2e = load_e2e()
    args = argparse.Namespace(window=20, task="addmod10", filter_zero_variance=1, async_publish_every=3,
                              async_prompts=24, generator_cpus="1", loop_cpus="0,1", sf=["trainer.lr=1e-3"])
    sync, asyn = e2e.mode_settings(args, 0), e2e.mode_settings(args, 4)
    diff = e2e.differences(sync, asyn)
    assert set(diff) == {"staleness.max_versions", "trainer.publish_busy", "trainer.publish_every",
                         "generator.max_concurrent_prompts", "generator.vllm_executor"}
    assert diff["trainer.publish_every"] == {"sync": "default", "async": 3,
                                             "why": e2e.WHY_DIFFERENT["trainer.publish_every"]}
    assert sync["trainer.lr"] == asyn["trainer.lr"] == "1e-3" and sync["generator.cpus"] == asyn["generator.cpus"]
    with pytest.raises(SystemExit, match="trainer.lr differs"):  # a difference nobody explained stops the bench
        e2e.differences(sync, {**asyn, "trainer.lr": "2e-3"})
