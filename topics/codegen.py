"""Straight-line encode and decode functions for one schema, generated once when the codec registers it.

The codec's canonical layout is fixed per schema (``topics/codec.py``), so the code that writes it and finishes
reading it can be written out field by field, the way ``dataclasses`` writes ``__init__``: no loop over fields, no
tuple unpacking per tensor, one list display for the plain fields. On an Episode that is about a third of the
encoder's time.

Safety: the only text compiled is assembled here from a registered schema class's field names (each checked to be
a Python identifier and no keyword) and the fixed templates below; every value the code uses (key bytes, dtypes,
packers, the class) is passed in its namespace, never written into the source. No message byte ever reaches
``_compile``, which is the one ``exec`` site the security scan allows (``tests/unit/test_security_wire.py``).
Each function keeps its source in ``__source__`` for anyone who wants to read what runs.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TensorWrite:
    """How one tensor field is written: ``pack(prefix, dims..., data_key, nbytes)`` gives its head (see the codec's
    ``_TensorLayout``), then come the array's own bytes."""

    name: str
    ndim: int
    prefix: bytes
    pack: Callable[..., bytes]
    dtype: Any  # numpy dtype
    itemsize: int


def _field(name: str) -> str:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise TypeError(f"schema field name {name!r} is not a Python identifier")
    return name


def _compile(fname: str, lines: list[str], namespace: dict[str, Any]) -> Callable[..., Any]:
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<streamforge codec: {fname}>", "exec"), namespace)  # noqa: S102 -- see module docstring
    fn = namespace[fname]
    fn.__source__ = source
    return fn


def encoder(head: bytes, tensors: Sequence[TensorWrite], plain: Sequence[str], *,
            as_tensor: Callable[..., Any], tensor_head: Callable[..., bytes], data_key: bytes,
            pack: Callable[[Any], bytes], ndarray: type) -> Callable[[Any, bool], bytes]:
    """``encode(msg, convert) -> bytes``: the head, each tensor's head and bytes, then the plain fields packed as
    one flat list ``[key, value, ...]`` whose array header is cut off (what is left is exactly the map's remaining
    entries). An array of another type, dtype or rank goes through ``as_tensor`` (convert or raise); with
    ``convert`` a non-contiguous array is copied too (``bytes.join`` refuses one with a ``TypeError``)."""
    ns: dict[str, Any] = {"HEAD": head, "DATA": data_key, "pack": pack, "join": b"".join, "memoryview": memoryview,
                          "ndarray": ndarray, "as_tensor": as_tensor, "tensor_head": tensor_head}
    lines = ["def encode(msg, convert):"]
    parts = ["HEAD"]
    for i, t in enumerate(tensors):
        name = _field(t.name)
        ns.update({f"p{i}": t.pack, f"x{i}": t.prefix, f"d{i}": t.dtype})
        lines += [
            f"    t{i} = msg.{name}",
            (f"    if (type(t{i}) is not ndarray or (t{i}.dtype is not d{i} and t{i}.dtype != d{i})"
             f" or t{i}.ndim != {t.ndim} or (convert and not t{i}.flags.c_contiguous)):"),
            f"        t{i} = as_tensor(t{i}, d{i}, {t.ndim}, {name!r})",
        ]
        if t.ndim == 1:
            lines += [f"    n{i} = len(t{i})", f"    h{i} = p{i}(x{i}, n{i}, DATA, n{i} * {t.itemsize})"]
        else:
            lines.append(f"    h{i} = tensor_head(p{i}, x{i}, t{i}.shape, t{i}.nbytes)")
        parts += [f"h{i}", f"t{i}"]
    pairs = ", ".join(f"{_field(n)!r}, msg.{n}" for n in plain)
    strip = 1 if 2 * len(plain) < 16 else 3 if 2 * len(plain) < 2**16 else 5
    lines.append(f"    plain = memoryview(pack([{pairs}]))[{strip}:]")
    lines.append(f"    return join(({', '.join(parts)}, plain))")
    return _compile("encode", lines, ns)


def finisher(cls: type, tensors: Sequence[tuple[str, Any, int]], raw_maps: Sequence[str], *,
             frombuffer: Callable[..., Any], first_byte: Callable[[Any], tuple[int]], bin_payload_at: Sequence[int],
             unpack_map: Callable[[Any], Any], is_str: Callable[[Any], bool]) -> Callable[[Any], Any]:
    """``finish(twin) -> msg | None``: given what msgspec decoded (the schema's wire twin, see the codec's
    ``_wire_twin``), put each tensor's array in its slot, each raw ``dict[str, Any]`` field's map, and make the
    object a ``cls``. A tensor's ``data`` is its encoded value (a ``msgspec.Raw``), and
    ``bin_payload_at[first_byte(data)[0]]`` says where its bin payload starts (-1: not a bin). None where it is no
    bin, the bytes do not fill a 1-D tensor's shape exactly, or a raw field is not a map with str keys; numpy
    raises where they do not fill another shape (the caller treats both alike)."""
    ns: dict[str, Any] = {"cls": cls, "frombuffer": frombuffer, "first_byte": first_byte,
                          "bin_payload_at": bin_payload_at, "unpack_map": unpack_map, "is_str": is_str}
    lines = ["def finish(msg):"]
    for i, (name, dtype, ndim) in enumerate(tensors):
        name = _field(name)
        ns[f"d{i}"] = dtype
        lines += [f"    w = msg.{name}", "    r = w.data", "    o = bin_payload_at[first_byte(r)[0]]", "    if o < 0:",
                  "        return None"]
        if ndim == 1:
            lines += [f"    a = frombuffer(r, d{i}, -1, o)", "    if len(a) != w.shape[0]:", "        return None",
                      f"    msg.{name} = a"]
        else:
            lines.append(f"    msg.{name} = frombuffer(r, d{i}, -1, o).reshape(w.shape)")
    for name in raw_maps:
        name = _field(name)
        lines += [f"    v = unpack_map(msg.{name})", "    if type(v) is not dict or not all(map(is_str, v)):",
                  "        return None", f"    msg.{name} = v"]
    lines += ["    msg.__class__ = cls", "    return msg"]
    return _compile("finish", lines, ns)
