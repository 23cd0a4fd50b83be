"""W3C trace context (``traceparent``/``tracestate``) in Kafka and NATS headers.

Kafka headers are a list of ``(str, bytes)``; NATS headers a ``dict[str, str]``. Both go through the
globally configured OpenTelemetry propagator (W3C TraceContext by default).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.trace import Link, get_current_span

TRACE_HEADERS = ("traceparent", "tracestate")


def kafka_headers(extra: Iterable[tuple[str, bytes]] = (), ctx: otel_context.Context | None = None) -> list[tuple[str, bytes]]:
    """Headers for a Kafka record: ``extra`` plus the trace context of ``ctx`` (default: the current one)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    out = [(k, v) for k, v in extra if k not in carrier]
    out.extend((k, v.encode()) for k, v in carrier.items())
    return out


def nats_headers(extra: Mapping[str, str] | None = None, ctx: otel_context.Context | None = None) -> dict[str, str]:
    carrier: dict[str, str] = dict(extra or {})
    propagate.inject(carrier, context=ctx)
    return carrier


def context_from_kafka(headers: Mapping[str, bytes] | Iterable[tuple[str, bytes]]) -> otel_context.Context:
    items = headers.items() if isinstance(headers, Mapping) else headers
    carrier = {}
    for k, v in items:
        if k in TRACE_HEADERS and v is not None:
            try:
                carrier[k] = v.decode() if isinstance(v, (bytes, bytearray)) else str(v)
            except UnicodeDecodeError:
                continue
    return propagate.extract(carrier)


def context_from_nats(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


def link_to(ctx: otel_context.Context) -> Link | None:
    """A span link to the span carried by ``ctx`` (for spans that join many inputs), or None if it has none."""
    span_ctx = get_current_span(ctx).get_span_context()
    return Link(span_ctx) if span_ctx.is_valid else None


def context_of_version(pv: object) -> otel_context.Context:
    """The trace context a PolicyVersion was published in (empty context if none was recorded)."""
    return propagate.extract(dict(getattr(pv, "trace_context", None) or {}))
