"""msgpack codec for the schemas in ``topics/schemas.py``. Never pickle.

Format (documented so any msgpack reader can decode it):

* a message is one msgpack map: ``{"schema": str, "v": int, <field name>: <value>, ...}``;
* plain fields are msgpack scalars, arrays and maps (``bytes`` fields are msgpack bin);
* a tensor field is the map ``{"dtype": "<numpy dtype name>", "shape": [d0, d1, ...], "data": <bin>}`` holding the
  raw little-endian C-order bytes; it decodes as a read-only ``np.frombuffer`` view of the received bytes
  (no copy beyond the one msgpack makes for the bin).

``decode`` never raises anything but a ``CodecError`` subclass, whatever the input: ``MalformedMessage``,
``UnknownSchema``, ``MessageTooLarge`` or ``InvalidMessage`` (each with ``retriable = False`` and a ``reason``
used on the dead-letter topic).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from topics import schemas
from topics.errors import CodecError, InvalidMessage, MalformedMessage, MessageTooLarge, UnknownSchema

DEFAULT_MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _FieldSpec:
    name: str
    kind: str  # str | int | float | bool | bytes | dict_float | dict_any | list_str | tensor
    required: bool
    dtype: str = ""
    ndim: int = 0
    np_dtype: Any = None  # little-endian numpy dtype of a tensor field
    exact: Any = None  # the Python type a value of a simple kind must have exactly (fast path)


def _kind_of(tp: Any) -> str:
    if tp is str:
        return "str"
    if tp is int:
        return "int"
    if tp is float:
        return "float"
    if tp is bool:
        return "bool"
    if tp is bytes:
        return "bytes"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is dict:
        return "dict_float" if args[1] is float else "dict_any"
    if origin is list and args == (str,):
        return "list_str"
    raise TypeError(f"unsupported schema field type {tp!r}")


def _specs(cls: type) -> tuple[_FieldSpec, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if "tensor" in f.metadata:
            dtype, ndim = f.metadata["tensor"]
            out.append(_FieldSpec(f.name, "tensor", required, dtype, ndim, np.dtype(dtype).newbyteorder("<")))
        else:
            kind = _kind_of(hints[f.name])
            exact = {"str": str, "int": int, "float": float, "bool": bool, "bytes": bytes}.get(kind)
            out.append(_FieldSpec(f.name, kind, required, exact=exact))
    return tuple(out)


_REGISTRY: dict[tuple[str, int], type] = {}
_SPECS: dict[type, tuple[_FieldSpec, ...]] = {}


def register(cls: type) -> type:
    """Register a schema class (``SCHEMA``/``VERSION`` class vars) with the codec."""
    _REGISTRY[(cls.SCHEMA, cls.VERSION)] = cls
    _SPECS[cls] = _specs(cls)
    return cls


for _cls in schemas.ALL_SCHEMAS:
    register(_cls)


def known_schemas() -> dict[tuple[str, int], type]:
    return dict(_REGISTRY)


# --- encode ---------------------------------------------------------------------------------


def _encode_tensor(name: str, arr: Any, spec: _FieldSpec) -> dict[str, Any]:
    if type(arr) is not np.ndarray or arr.dtype != spec.np_dtype or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(np.asarray(arr).astype(spec.np_dtype, copy=False))
    if arr.ndim != spec.ndim:
        raise InvalidMessage(f"field {name!r}: expected rank {spec.ndim}, got shape {arr.shape}")
    data = arr.data.cast("B") if arr.size else b""
    return {"dtype": spec.dtype, "shape": list(arr.shape), "data": data}


def to_wire(msg: Any) -> dict[str, Any]:
    """The msgpack-ready map of a schema instance (tensors become dtype/shape/data maps)."""
    cls = type(msg)
    specs = _SPECS.get(cls)
    if specs is None:
        raise CodecError(f"{cls.__name__} is not a registered schema")
    validate = getattr(msg, "validate", None)
    if validate is not None:
        validate()
    out: dict[str, Any] = {"schema": cls.SCHEMA, "v": cls.VERSION}
    for spec in specs:
        value = getattr(msg, spec.name)
        out[spec.name] = value if spec.np_dtype is None else _encode_tensor(spec.name, value, spec)
    return out


def encode(msg: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Encode a schema instance. Raises ``InvalidMessage`` for a bad instance, ``MessageTooLarge`` over the limit."""
    try:
        data = msgpack.packb(to_wire(msg), use_bin_type=True)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidMessage(f"cannot encode {type(msg).__name__}: {exc}") from exc
    if len(data) > max_bytes:
        raise MessageTooLarge(len(data), max_bytes)
    return data


# --- decode ---------------------------------------------------------------------------------


def _decode_tensor(name: str, value: Any, spec: _FieldSpec) -> np.ndarray:
    if type(value) is not dict or len(value) != 3:
        raise MalformedMessage(f"field {name!r}: a tensor must be a map of dtype, shape and data")
    try:
        dtype, shape, data = value["dtype"], value["shape"], value["data"]
    except KeyError:
        raise MalformedMessage(f"field {name!r}: a tensor must be a map of dtype, shape and data") from None
    if dtype != spec.dtype:
        raise InvalidMessage(f"field {name!r}: dtype {dtype!r}, expected {spec.dtype!r}")
    if type(shape) is not list or len(shape) != spec.ndim:
        raise InvalidMessage(f"field {name!r}: shape {shape!r} is not a rank-{spec.ndim} shape")
    count = 1
    for d in shape:
        if type(d) is not int or not 0 <= d < 2**31:
            raise InvalidMessage(f"field {name!r}: shape {shape!r} is not a rank-{spec.ndim} shape")
        count *= d
    if type(data) is not bytes:
        raise MalformedMessage(f"field {name!r}: data must be bin")
    if len(data) != count * spec.np_dtype.itemsize:
        raise MalformedMessage(f"field {name!r}: {len(data)} bytes do not fill shape {shape} of {dtype}")
    arr = np.frombuffer(data, dtype=spec.np_dtype)
    return arr if spec.ndim == 1 else arr.reshape(shape)


_SIMPLE = {"str": (str,), "int": (int,), "bool": (bool,), "bytes": (bytes,)}


def _check(name: str, kind: str, value: Any) -> Any:
    simple = _SIMPLE.get(kind)
    if simple is not None:
        if type(value) in simple:
            return value
    elif kind == "float":
        if type(value) is float:
            return value
        if type(value) is int:
            return float(value)
    elif kind == "dict_float":
        if type(value) is dict:
            out = {}
            for k, v in value.items():
                if type(k) is not str or type(v) not in (int, float):
                    break
                out[k] = float(v)
            else:
                return out
    elif kind == "dict_any":
        if type(value) is dict and all(type(k) is str for k in value):
            return value
    elif kind == "list_str":
        if type(value) is list and all(type(v) is str for v in value):
            return value
    raise MalformedMessage(f"field {name!r}: expected {kind}, got {type(value).__name__}")


_MISSING = object()


def from_wire(obj: Any) -> Any:
    """Rebuild a schema instance from a decoded msgpack map (validating every field)."""
    if not isinstance(obj, dict):
        raise MalformedMessage(f"a message must be a msgpack map, got {type(obj).__name__}")
    name, version = obj.get("schema"), obj.get("v")
    cls = _REGISTRY.get((name, version)) if isinstance(name, str) and type(version) is int else None
    if cls is None:
        raise UnknownSchema(name, version)
    kwargs: dict[str, Any] = {}
    for spec in _SPECS[cls]:
        value = obj.get(spec.name, _MISSING)
        if value is _MISSING:
            if spec.required:
                raise MalformedMessage(f"{name} v{version}: missing field {spec.name!r}")
            continue
        if type(value) is spec.exact:
            kwargs[spec.name] = value
        elif spec.np_dtype is not None:
            kwargs[spec.name] = _decode_tensor(spec.name, value, spec)
        else:
            kwargs[spec.name] = _check(spec.name, spec.kind, value)
    msg = cls(**kwargs)
    validate = getattr(msg, "validate", None)
    if validate is not None:
        validate()
    return msg


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES, expect: type | None = None) -> Any:
    """Decode bytes into a schema instance; ``expect`` restricts the accepted schema class.

    Raises only ``CodecError`` subclasses (never crashes the reader on hostile input).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise MessageTooLarge(len(data), max_bytes)
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True
        )
    except Exception as exc:  # msgpack raises many types for hostile input; all mean "malformed"
        raise MalformedMessage(f"not a msgpack message: {type(exc).__name__}: {exc}") from exc
    try:
        msg = from_wire(obj)
    except CodecError:
        raise
    except Exception as exc:  # e.g. numpy refusing a shape; still the sender's fault
        raise MalformedMessage(f"cannot decode message: {type(exc).__name__}: {exc}") from exc
    if expect is not None and not isinstance(msg, expect):
        raise InvalidMessage(f"expected a {expect.SCHEMA} message, got {type(msg).SCHEMA}")
    return msg
