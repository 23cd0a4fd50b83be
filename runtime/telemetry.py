"""OpenTelemetry setup: one tracer provider per role process, spans to ``<run_dir>/traces.jsonl`` or OTLP.

``traces.jsonl`` format (a contract other tools read): one JSON object per finished span with ``trace_id``
(32 hex), ``span_id`` (16 hex), ``parent_span_id`` (16 hex or null), ``name``, ``start_time`` and ``end_time``
(Unix nanoseconds), ``attributes``, ``links`` (list of ``{"trace_id", "span_id", "attributes"}``), ``service``
(the role), ``status``. Several processes append to the same file; each span is one ``write`` of one line.
Context crosses processes in Kafka and NATS headers (``topics/tracing.py``, W3C traceparent).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

_provider: TracerProvider | None = None


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": _hex(ctx.trace_id, 32),
        "span_id": _hex(ctx.span_id, 16),
        "parent_span_id": _hex(parent.span_id, 16) if parent is not None else None,
        "name": span.name,
        "start_time": span.start_time,
        "end_time": span.end_time,
        "attributes": dict(span.attributes or {}),
        "links": [
            {"trace_id": _hex(link.context.trace_id, 32), "span_id": _hex(link.context.span_id, 16),
             "attributes": dict(link.attributes or {})}
            for link in span.links
        ],
        "service": span.resource.attributes.get("service.name", ""),
        "status": span.status.status_code.name,
    }


class JsonlSpanExporter(SpanExporter):
    """Appends finished spans to a JSON-lines file (one ``os.write`` per span, safe across processes)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            for span in spans:
                os.write(self._fd, orjson.dumps(span_to_dict(span), default=str) + b"\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def setup_tracing(service_name: str, run_dir: str | os.PathLike | None, *, exporter: str = "jsonl",
                  otlp_endpoint: str = "") -> TracerProvider | None:
    """Install the global tracer provider for this process (once). ``exporter``: jsonl | otlp | none."""
    global _provider
    if _provider is not None or exporter == "none":
        return _provider
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter == "jsonl":
        if run_dir is None:
            raise ValueError("the jsonl trace exporter needs a run directory")
        provider.add_span_processor(BatchSpanProcessor(JsonlSpanExporter(Path(run_dir) / "traces.jsonl"),
                                                       schedule_delay_millis=500))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    else:
        raise ValueError(f"unknown trace exporter {exporter!r}")
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flush and close the exporter (call before the process exits)."""
    if _provider is not None:
        _provider.force_flush()
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    """Every JSON line of a file appended to by several processes (a torn last line is skipped)."""
    out = []
    with open(path, "rb") as fh:
        for line in fh:
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return out


def read_spans(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every span in a traces.jsonl file (a torn last line is skipped)."""
    return read_jsonl(path)
