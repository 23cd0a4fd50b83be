"""traces.jsonl spans (the run-dir contract), the trace tree view, and record_metric reductions/backends."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link

from runtime.metrics import MetricsLogger, reduce_values
from runtime.telemetry import JsonlSpanExporter, read_spans
from streamforge.traceview import episode_spans, render_episode_trace


def _provider(path: Path, service: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
    return provider


def test_spans_are_written_with_the_documented_fields(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    gen = _provider(path, "generator").get_tracer("t")
    trainer = _provider(path, "trainer").get_tracer("t")
    with gen.start_as_current_span("generate", attributes={"episode.id": "g/0"}) as parent:
        with gen.start_as_current_span("reward"):
            pass
    with gen.start_as_current_span("generate", attributes={"episode.id": "h/0"}):
        pass
    with trainer.start_as_current_span("train_step", links=[Link(parent.get_span_context())],
                                       attributes={"step": 1}) as step:
        pass
    with trainer.start_as_current_span("swap", links=[Link(step.get_span_context())]):
        pass
    spans = read_spans(path)
    assert len(spans) == 5
    for s in spans:
        assert set(s) >= {"trace_id", "span_id", "parent_span_id", "name", "start_time", "end_time",
                          "attributes", "links", "service"}
        assert len(s["trace_id"]) == 32 and len(s["span_id"]) == 16 and s["end_time"] >= s["start_time"]
    reward = next(s for s in spans if s["name"] == "reward")
    assert reward["parent_span_id"] == format(parent.get_span_context().span_id, "016x")
    path_spans = episode_spans(spans, "g/0")
    assert {s["name"] for s in path_spans} == {"generate", "reward", "train_step", "swap"}
    assert all(s["attributes"].get("episode.id") != "h/0" for s in path_spans)
    text = render_episode_trace(path, "g/0")
    assert "generate [generator]" in text and "  reward" in text and "train_step [trainer]" in text
    assert "<- links generate" in text
    assert render_episode_trace(path, "missing/0") is None


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    path.write_bytes(orjson.dumps({"trace_id": "a"}) + b"\n{\"trace")
    assert read_spans(path) == [{"trace_id": "a"}]


def test_reductions() -> None:
    values = [1.0, 2.0, 3.0, 6.0]
    assert reduce_values(values, "mean") == 3.0
    assert reduce_values(values, "sum") == 12.0
    assert reduce_values(values, "max") == 6.0 and reduce_values(values, "min") == 1.0
    assert reduce_values(values, "std") == pytest.approx(1.8708, rel=1e-4)
    with pytest.raises(ValueError):
        reduce_values(values, "median")


def test_metrics_logger_jsonl_backend(tmp_path: Path) -> None:
    logger = MetricsLogger("buffer", tmp_path, ["jsonl", "console"])
    logger.record("buffer/dropped/stale", 2, "sum")
    logger.record("buffer/dropped/stale", 3, "sum")
    logger.record("buffer/group_reward", 0.5)
    logger.record("buffer/group_reward", 1.0)
    assert logger.flush(1) == {"buffer/dropped/stale": 5.0, "buffer/group_reward": 0.75}
    assert logger.flush(2) == {}
    rows = [orjson.loads(line) for line in (tmp_path / "metrics-buffer.jsonl").read_bytes().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["buffer/dropped/stale"] == 5.0
    with pytest.raises(ValueError):
        logger.record("x", 1, "median")
