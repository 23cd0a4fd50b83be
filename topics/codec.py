"""msgpack codec for the schemas in ``topics/schemas.py``. Never pickle.

Format (documented so any msgpack reader can decode it):

* a message is one msgpack map: ``{"schema": str, "v": int, <field name>: <value>, ...}``;
* plain fields are msgpack scalars, arrays and maps (``bytes`` fields are msgpack bin);
* a tensor field is the map ``{"dtype": "<numpy dtype name>", "shape": [d0, d1, ...], "data": <bin>}`` holding the
  raw little-endian C-order bytes.

``encode`` writes one canonical layout of that map: ``schema`` and ``v`` first, then the tensor fields in schema
order (dims as uint32, ``data`` as bin32), then the plain fields. It assembles the bytes itself, so tensor bytes
are copied once, straight into the message; the plain fields are packed by msgspec's msgpack encoder (the same
bytes msgpack-python writes, at a third of the cost). ``decode`` reads a message whose head is canonical with one
typed msgspec decode into the schema's wire twin (every field's type, each tensor's dtype, rank and dims checked
in C; see ``_wire_twin``): tensors become read-only ``np.frombuffer`` views of the message bytes (zero copy; a decoded message keeps
the bytes it came from alive, and a view need not be aligned to its dtype, which numpy and torch handle;
``np.array(view)`` copies). Whatever that typed decode refuses, and any message whose head is not canonical, goes
through the generic path, ``msgpack.unpackb`` plus ``from_wire``, which gives the verdict: the typed decode only
ever accepts what the generic path decodes to the same message (a fuzz test holds them to it), so keys in another
order, other int or bin widths, an int for a float, duplicate keys (the last wins) and extra keys all decode as
``msgpack.unpackb`` sees them. A ``bytearray`` or ``memoryview`` input is copied to ``bytes`` first, so a caller
may reuse its buffer after ``decode`` returns.

``decode`` never raises anything but a ``CodecError`` subclass, whatever the input: ``MalformedMessage``,
``UnknownSchema``, ``MessageTooLarge`` or ``InvalidMessage`` (each with ``retriable = False`` and a ``reason``
used on the dead-letter topic).
"""

from __future__ import annotations

import dataclasses
import struct
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgpack
import msgspec
import numpy as np

from topics import codegen, schemas
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
            np_dtype = np.dtype(dtype).newbyteorder("<")
            if np_dtype == np.dtype(dtype):
                np_dtype = np.dtype(dtype)  # numpy's own instance on a little-endian host: ``is`` compares it
            out.append(_FieldSpec(f.name, "tensor", required, dtype, ndim, np_dtype))
        else:
            kind = _kind_of(hints[f.name])
            exact = {"str": str, "int": int, "float": float, "bool": bool, "bytes": bytes}.get(kind)
            out.append(_FieldSpec(f.name, kind, required, exact=exact))
    return tuple(out)


# --- the canonical layout, precomputed per schema -------------------------------------------

_UINT32 = 0xCE
_DATA_BIN32 = b"\xa4data\xc6"  # the tensor map's "data" key and a bin32 header; its 4-byte length follows


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x80 | n,))
    return struct.pack(">BH", 0xDE, n) if n < 2**16 else struct.pack(">BI", 0xDF, n)


@dataclass(frozen=True, slots=True)
class _TensorLayout:
    """One tensor entry in the canonical layout: ``prefix`` (the key, the tensor map's header, the dtype entry, the
    "shape" key, the array header and the first dim's uint32 tag), the dims (tagged uint32), the "data" key with a
    bin32 header and length, then the raw bytes. ``head`` packs all but the raw bytes in one call."""

    spec: _FieldSpec
    prefix: bytes
    head: struct.Struct

    @classmethod
    def of(cls, spec: _FieldSpec) -> _TensorLayout:
        if spec.ndim > 15:
            raise TypeError(f"tensor field {spec.name!r}: rank {spec.ndim} > 15")
        prefix = (msgpack.packb(spec.name) + b"\x83\xa5dtype" + msgpack.packb(spec.dtype) + b"\xa5shape"
                  + bytes((0x90 | spec.ndim,)) + (bytes((_UINT32,)) if spec.ndim else b""))
        # Dims are signed here: a dim >= 2**31 (the decoders' bound) fails to pack.
        dims = "i" + "Bi" * (spec.ndim - 1) if spec.ndim else ""
        return cls(spec, prefix, struct.Struct(f">{len(prefix)}s{dims}{len(_DATA_BIN32)}sI"))


# A tensor dim as the generic decoder accepts it: an int (not a bool) in [0, 2**31).
_Dim = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


def _wire_type(tp: Any, kind: str) -> Any:
    """The msgspec type of a plain field: exactly what ``_check`` accepts (msgspec also takes an int for a float,
    as ``_check`` does). ``dict[str, Any]`` stays raw msgpack, read by ``msgpack.unpackb`` as the generic path
    reads it (msgspec's ``Any`` would accept non-str keys of nested maps and decode ext types its own way)."""
    return msgspec.Raw if kind == "dict_any" else tp


def _tensor_wire(cls: type, spec: _FieldSpec) -> type:
    """The msgspec Struct of one tensor field: ``{dtype, shape, data}`` with the dtype a literal, the shape a tuple
    of exactly ``ndim`` dims, and no other keys. ``data`` is the value's encoded bytes as a zero-copy
    ``msgspec.Raw``, not a memoryview; the generated ``finish`` checks it is one msgpack bin (``_BIN_PAYLOAD_AT``).
    The arrays of a decoded message keep their bytes alive through it, and a Raw is no object the cycle collector
    tracks, where a memoryview and its managed buffer are two: in the buffer, which holds thousands of episodes,
    the eight of an episode's four tensors made the collector's passes about a third of its CPU. The struct is
    untracked too (``gc=False``: it holds no container that could close a cycle)."""
    return msgspec.defstruct(
        f"{cls.__name__}_{spec.name}_wire",
        [("dtype", Literal[spec.dtype]), ("shape", tuple[(_Dim,) * spec.ndim] if spec.ndim else tuple[()]),
         ("data", msgspec.Raw)],
        forbid_unknown_fields=True, gc=False)


_FIRST_BYTE = struct.Struct("B").unpack_from
# Where a msgpack bin's payload starts, by its first byte (-1: not a bin). A ``msgspec.Raw`` is exactly one
# encoded value, so a bin's header and the Raw's length always agree: the first byte says it all.
_BIN_PAYLOAD_AT = tuple({0xC4: 2, 0xC5: 3, 0xC6: 5}.get(b, -1) for b in range(256))


def _wire_twin(cls: type, specs: tuple[_FieldSpec, ...]) -> type:
    """The type msgspec decodes one message of ``cls`` into: a slots dataclass with exactly ``cls``'s fields in
    ``cls``'s order (so the same slot layout), each tensor field a ``_tensor_wire`` struct and every other field
    of its schema type. The decoder sets the fields without calling ``__init__``; the plan's generated ``finish``
    (``topics/codegen.py``) then puts each tensor's array in its slot and makes the object a ``cls`` (``__class__``
    assignment, which Python allows between classes of the same slot layout). Every field is required: the encoder writes them all, and a message
    that leaves one out (to its default) reads through the generic path. ``schema`` and ``v`` are not fields:
    the canonical head names them, and a later duplicate of either goes to the generic path (see
    ``_canonical_message``)."""
    hints = typing.get_type_hints(cls)
    return dataclasses.make_dataclass(
        f"{cls.__name__}Wire",
        [(s.name, _tensor_wire(cls, s) if s.np_dtype is not None else _wire_type(hints[s.name], s.kind))
         for s in specs],
        slots=True)


class _Plan:
    """How one schema class is written and read in the canonical layout (all precomputed at registration)."""

    __slots__ = ("cls", "count", "decoder", "encode", "finish", "head", "head_key", "plain_names", "tensors",
                 "validate")

    def __init__(self, cls: type, specs: tuple[_FieldSpec, ...]) -> None:
        self.cls = cls
        tensors = [s for s in specs if s.np_dtype is not None]
        self.tensors = tuple(_TensorLayout.of(s) for s in tensors)
        self.plain_names = tuple(s.name for s in specs if s.np_dtype is None)
        # After the map header: the bytes a canonical message of this class starts with ("schema" and "v").
        self.head_key = msgpack.packb("schema") + msgpack.packb(cls.SCHEMA) + msgpack.packb("v") + msgpack.packb(
            cls.VERSION)
        self.count = 2 + len(specs)
        self.head = _map_header(self.count) + self.head_key
        self.decoder = msgspec.msgpack.Decoder(_wire_twin(cls, specs))
        self.encode = codegen.encoder(
            self.head,
            [codegen.TensorWrite(t.spec.name, t.spec.ndim, t.prefix, t.head.pack, t.spec.np_dtype,
                                 t.spec.np_dtype.itemsize) for t in self.tensors],
            self.plain_names, as_tensor=_as_tensor, tensor_head=_tensor_head, data_key=_DATA_BIN32, pack=_pack,
            ndarray=np.ndarray)
        self.finish = codegen.finisher(
            cls, [(s.name, s.np_dtype, s.ndim) for s in tensors], [s.name for s in specs if s.kind == "dict_any"],
            frombuffer=np.frombuffer, first_byte=_FIRST_BYTE, bin_payload_at=_BIN_PAYLOAD_AT,
            unpack_map=_unpack_map, is_str=str.__instancecheck__)  # exact: no subclasses
        self.validate = getattr(cls, "validate", None)


def _unpack_map(raw: Any) -> Any:
    """A raw ``dict[str, Any]`` field's value as the generic path reads it."""
    return msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)


# msgspec's encoder writes the plain fields: for the types the schemas hold, byte for byte what
# ``msgpack.packb(obj, use_bin_type=True)`` writes. One instance serves every thread (each call has its own buffer).
_pack = msgspec.msgpack.Encoder().encode


_REGISTRY: dict[tuple[str, int], type] = {}
_SPECS: dict[type, tuple[_FieldSpec, ...]] = {}
_PLANS: dict[type, _Plan] = {}
_HEADS: dict[bytes, _Plan] = {}  # head_key -> plan, for the canonical decoder


def register(cls: type) -> type:
    """Register a schema class (``SCHEMA``/``VERSION`` class vars) with the codec."""
    specs = _specs(cls)
    plan = _Plan(cls, specs)
    old = _PLANS.get(cls)
    if old is not None:
        _HEADS.pop(old.head_key, None)
    _REGISTRY[(cls.SCHEMA, cls.VERSION)] = cls
    for older in getattr(cls, "OLDER_VERSIONS", ()):  # read through the generic path, missing fields defaulted
        _REGISTRY[(cls.SCHEMA, older)] = cls
    _SPECS[cls] = specs
    _PLANS[cls] = plan
    _HEADS[plan.head_key] = plan
    return cls


def known_schemas() -> dict[tuple[str, int], type]:
    return dict(_REGISTRY)


# --- encode ---------------------------------------------------------------------------------


def _as_tensor(arr: Any, dtype: np.dtype, ndim: int, name: str = "") -> np.ndarray:
    if type(arr) is not np.ndarray or arr.dtype != dtype or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(np.asarray(arr).astype(dtype, copy=False))
    if arr.ndim != ndim:
        raise InvalidMessage(f"field {name!r}: expected rank {ndim}, got shape {arr.shape}")
    return arr


def _encode_tensor(name: str, arr: Any, spec: _FieldSpec) -> dict[str, Any]:
    arr = _as_tensor(arr, spec.np_dtype, spec.ndim, name)
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


def _tensor_head(pack: Any, prefix: bytes, shape: tuple[int, ...], nbytes: int) -> bytes:
    args: list[Any] = [prefix, *shape[:1]]
    for d in shape[1:]:
        args += (_UINT32, d)
    return pack(*args, _DATA_BIN32, nbytes)


def encode(msg: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Encode a schema instance. Raises ``InvalidMessage`` for a bad instance, ``MessageTooLarge`` over the limit.

    Writes the canonical layout (see the module docstring) with the schema's generated encoder
    (``topics/codegen.py``): one ``bytes.join`` of precomputed key bytes, the tensors' own buffers and one msgpack
    packing of the plain fields, so tensor bytes are copied once.
    """
    plan = _PLANS.get(type(msg))
    if plan is None:
        raise CodecError(f"{type(msg).__name__} is not a registered schema")
    if plan.validate is not None:
        plan.validate(msg)
    try:
        try:
            data = plan.encode(msg, False)
        except TypeError:  # maybe a non-contiguous array, which exports no plain buffer: copy it
            data = plan.encode(msg, True)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError, struct.error) as exc:
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
    elif kind == "list_str" and type(value) is list and all(type(v) is str for v in value):
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


def _canonical_message(data: bytes) -> Any:
    """The message (not yet validated) of bytes with a canonical head; None for any other bytes.

    None is no verdict: the caller then decodes ``data`` through the generic path, which raises the typed error
    if there is one. This reader accepts a message only where the generic path would decode the same fields:
    msgspec checks every type (see ``_wire_twin``), and here each tensor's bytes must fill its shape exactly. The
    head counts ``2 + n`` entries, ``schema`` and ``v`` come first, and all ``n`` fields are required, so the
    other ``n`` keys are exactly the fields, each once (no duplicate, no unknown key).
    """
    try:
        b0 = data[0]
        if b0 & 0xF0 == 0x80:
            count, p = b0 & 0x0F, 1
        elif b0 == 0xDE:
            count, p = (data[1] << 8) | data[2], 3
        else:
            return None
        # "schema" (7 bytes), the name as a fixstr (1 + L bytes), "v" (2 bytes) and the version as a fixint (a
        # schema named in 32 characters or more, or at version 128 or more, always takes the generic path).
        plan = _HEADS.get(data[p:p + 11 + (data[p + 7] & 0x1F)])
        if plan is None or count != plan.count:
            return None  # another layout, another schema, or extra keys (which the generic path ignores)
        return plan.finish(plan.decoder.decode(data))
    except Exception:  # noqa: BLE001 -- truncated, not msgpack, a field of another type...: the generic path judges
        return None


def _decode_generic(data: bytes | bytearray | memoryview) -> Any:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types for hostile input; all mean "malformed"
        raise MalformedMessage(f"not a msgpack message: {type(exc).__name__}: {exc}") from exc
    return from_wire(obj)


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES, expect: type | None = None) -> Any:
    """Decode bytes into a schema instance; ``expect`` restricts the accepted schema class.

    Raises only ``CodecError`` subclasses (never crashes the reader on hostile input).
    """
    if type(data) is not bytes:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedMessage(f"expected bytes, got {type(data).__name__}")
        if len(data) > max_bytes:
            raise MessageTooLarge(len(data), max_bytes)
        try:
            data = bytes(data)  # decoded tensors are views of immutable bytes, never of the caller's buffer
        except Exception as exc:  # e.g. a memoryview of a non-contiguous buffer
            raise MalformedMessage(f"cannot read the message bytes: {type(exc).__name__}: {exc}") from exc
    if len(data) > max_bytes:
        raise MessageTooLarge(len(data), max_bytes)
    try:
        msg = _canonical_message(data)
        if msg is None:
            msg = _decode_generic(data)
        else:
            validate = _PLANS[type(msg)].validate
            if validate is not None:
                validate(msg)
    except CodecError:
        raise
    except Exception as exc:  # e.g. numpy refusing a shape; still the sender's fault
        raise MalformedMessage(f"cannot decode message: {type(exc).__name__}: {exc}") from exc
    if expect is not None and not isinstance(msg, expect):
        raise InvalidMessage(f"expected a {expect.SCHEMA} message, got {type(msg).SCHEMA}")
    return msg


# Registered last: a plan's generated code refers to the helpers above.
for _cls in schemas.ALL_SCHEMAS:
    register(_cls)
