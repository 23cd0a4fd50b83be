"""``streamforge config --explain``: every config key with its type, default, value and the comment beside it.

The comments are read from the source of the config dataclasses (the ``# ...`` after a field, or the comment lines
just above it), so the explanation is the code's own and cannot drift from it.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import typing
from typing import Any


def field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` from the class source: a trailing comment, else the comment block right above."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    for i, line in enumerate(lines, start=1):
        head = line.strip().split(":", 1)[0]
        if head not in names or ":" not in line or line.strip().startswith("#"):
            continue
        text = comments.get(i, "")
        if not text:  # the comment block right above the field
            above, j = [], i - 1
            while j in comments and lines[j - 1].strip().startswith("#"):
                above.insert(0, comments[j])
                j -= 1
            text = " ".join(above)
        out[head] = text
    return out


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def explain(config: Any) -> list[dict[str, Any]]:
    """One row per key of every section: ``key``, ``type``, ``default``, ``value``, ``help``."""
    rows = []
    for section in dataclasses.fields(config):
        sub = getattr(config, section.name)
        cls = type(sub)
        hints = typing.get_type_hints(cls)
        notes = field_comments(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            rows.append({"key": f"{section.name}.{f.name}", "type": _type_name(hints[f.name]),
                         "default": getattr(defaults, f.name), "value": getattr(sub, f.name),
                         "help": notes.get(f.name, "")})
    return rows


def explain_text(config: Any, section: str = "") -> str:
    """The rows of ``explain`` as text, grouped by section (one section with ``section``); keys whose value
    differs from the default are marked with ``*``."""
    out: list[str] = []
    current = ""
    for row in explain(config):
        sec = row["key"].split(".", 1)[0]
        if section and sec != section:
            continue
        if sec != current:
            current = sec
            doc = (type(getattr(config, sec)).__doc__ or "").strip().splitlines()[0]
            out.append(f"\n[{sec}] {doc}")
        mark = "*" if row["value"] != row["default"] else " "
        out.append(f" {mark} {row['key']} = {row['value']!r}  ({row['type']}; default {row['default']!r})")
        if row["help"]:
            out.append(f"      {row['help']}")
    return "\n".join(out).lstrip("\n") + "\n"
