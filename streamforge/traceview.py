"""``streamforge trace``: one episode's path through the system, from ``traces.jsonl``, as a timed tree.

A span belongs to an episode's path when it carries the episode id (attribute ``episode_id`` or ``episode.id``,
or a list in ``episode.ids``), when it shares a trace with such a span (the prompt's dispatch, generation, reward, produce),
or when it links to a span of that path (the buffer's batch decision, the trainer step, the PolicyVersion it
produced and each generator's swap to that version, which link to their inputs), transitively.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from runtime.telemetry import read_spans


def _mentions(span: dict[str, Any], episode_id: str) -> bool:
    attrs = span.get("attributes") or {}
    if attrs.get("episode_id") == episode_id or attrs.get("episode.id") == episode_id:
        return True
    ids = attrs.get("episode.ids")
    return isinstance(ids, (list, tuple)) and episode_id in ids


def episode_spans(spans: list[dict[str, Any]], episode_id: str) -> list[dict[str, Any]]:
    """The spans on the path of ``episode_id`` (see the module docstring)."""
    traces = {s["trace_id"] for s in spans if _mentions(s, episode_id)}
    if not traces:
        return []
    chosen = {s["span_id"] for s in spans if s["trace_id"] in traces}
    changed = True
    while changed:  # follow links forward: a span linking to a chosen span joins, with its whole trace
        changed = False
        for s in spans:
            if s["span_id"] in chosen:
                continue
            if any(link["span_id"] in chosen for link in s.get("links") or ()):
                traces.add(s["trace_id"])
                changed = True
        if changed:
            chosen = {s["span_id"] for s in spans if s["trace_id"] in traces}
    return [s for s in spans if s["span_id"] in chosen]


def render_tree(spans: list[dict[str, Any]]) -> str:
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        parent = s.get("parent_span_id")
        children[parent if parent in by_id else None].append(s)
    for kids in children.values():
        kids.sort(key=lambda s: s["start_time"])
    t0 = min(s["start_time"] for s in spans)
    lines: list[str] = []

    def show(span: dict[str, Any], depth: int) -> None:
        start_ms = (span["start_time"] - t0) / 1e6
        dur_ms = (span["end_time"] - span["start_time"]) / 1e6
        attrs = span.get("attributes") or {}
        brief = ", ".join(f"{k}={v}" for k, v in attrs.items() if k != "episode.ids")
        linked = [by_id[link["span_id"]]["name"] for link in span.get("links") or () if link["span_id"] in by_id]
        line = f"{'  ' * depth}{span['name']} [{span.get('service', '')}] +{start_ms:.1f} ms, {dur_ms:.1f} ms"
        if brief:
            line += f" ({brief[:160]})"
        if linked:
            line += f" <- links {', '.join(sorted(set(linked)))}"
        lines.append(line)
        for child in children.get(span["span_id"], []):
            show(child, depth + 1)

    for root in children[None]:
        show(root, 0)
    return "\n".join(lines)


def render_episode_trace(path: str | os.PathLike, episode_id: str) -> str | None:
    if not os.path.exists(path):
        return None
    spans = episode_spans(read_spans(path), episode_id)
    return render_tree(spans) if spans else None
