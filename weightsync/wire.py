"""The bytes of one weight push: a snapshot packed into flat buckets, and the header that describes them.

A ``Snapshot`` is the trainer's weights for one version copied into a few flat ``uint8`` buffers ("buckets", at
most ``bucket_bytes`` each unless one tensor is larger), so that

* the training step that follows can change the parameters while the copy is still being sent (overlap), and
* the transport moves a handful of large contiguous buffers instead of hundreds of small tensors.

Each tensor sits at an offset aligned to ``ALIGN`` bytes inside its bucket; ``Layout`` records for every tensor its
Hugging Face name, dtype, shape, bucket and offset. The header that travels in front of the buckets is the layout
plus the version as JSON (orjson; never pickle), so a receiver needs no prior knowledge of the model's names:

    header = {"format": 1, "version": int, "step": int, "buckets": [nbytes, ...],
              "params": [[name, dtype, [shape...], bucket, offset], ...]}

On a collective transport the header goes first (in a fixed-size preamble, see ``weightsync/collective.py``),
followed by one message per bucket, in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import orjson
import torch

from topics.errors import InvalidMessage

FORMAT = 1
ALIGN = 64  # bytes; a multiple of every element size so views of any dtype are legal

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidMessage(f"weight header names unsupported dtype {name!r}") from None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one tensor lives in the buckets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int

    @property
    def nbytes(self) -> int:
        n = dtype_of(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True)
class Layout:
    """Every tensor's slot and every bucket's size, for one version."""

    version: int
    step: int
    params: list[ParamSlot] = field(default_factory=list)
    buckets: list[int] = field(default_factory=list)  # bytes per bucket

    @property
    def total_bytes(self) -> int:
        return sum(self.buckets)

    def to_header(self) -> bytes:
        return orjson.dumps({
            "format": FORMAT, "version": self.version, "step": self.step, "buckets": self.buckets,
            "params": [[p.name, p.dtype, list(p.shape), p.bucket, p.offset] for p in self.params],
        })

    @classmethod
    def from_header(cls, data: bytes) -> Layout:
        """Parse and check a header; a malformed one raises ``InvalidMessage``."""
        try:
            obj = orjson.loads(data)
            if obj.get("format") != FORMAT:
                raise InvalidMessage(f"weight header format {obj.get('format')!r} is not {FORMAT}")
            layout = cls(version=int(obj["version"]), step=int(obj["step"]), buckets=[int(b) for b in obj["buckets"]])
            for name, dt, shape, bucket, offset in obj["params"]:
                layout.params.append(ParamSlot(str(name), str(dt), tuple(int(d) for d in shape), int(bucket),
                                               int(offset)))
        except InvalidMessage:
            raise
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidMessage(f"malformed weight header: {exc}") from exc
        layout.check()
        return layout

    def check(self) -> None:
        for p in self.params:
            dtype_of(p.dtype)
            if not 0 <= p.bucket < len(self.buckets) or p.offset < 0 or p.offset + p.nbytes > self.buckets[p.bucket]:
                raise InvalidMessage(f"weight header: {p.name} does not fit its bucket")

    def by_bucket(self) -> list[list[ParamSlot]]:
        out: list[list[ParamSlot]] = [[] for _ in self.buckets]
        for p in self.params:
            out[p.bucket].append(p)
        return out


def plan(named: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], *, version: int, step: int,
         bucket_bytes: int) -> Layout:
    """Assign tensors to buckets in the given order, closing a bucket when the next tensor would overflow it."""
    layout = Layout(version=version, step=step)
    used = 0
    for name, dtype, shape in named:
        slot_bytes = ParamSlot(name, dtype_name(dtype), tuple(shape), 0, 0).nbytes
        if not layout.buckets or (used and used + slot_bytes > bucket_bytes):
            layout.buckets.append(0)
            used = 0
        layout.params.append(ParamSlot(name, dtype_name(dtype), tuple(shape), len(layout.buckets) - 1, used))
        used = _align(used + slot_bytes)
        layout.buckets[-1] = used
    return layout


@dataclass(slots=True)
class Snapshot:
    """One version's weights, packed: the layout and one ``uint8`` buffer per bucket (read-only once built)."""

    layout: Layout
    buffers: list[torch.Tensor]

    @property
    def version(self) -> int:
        return self.layout.version

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as a view into the buckets (no copy), in layout order."""
        for p in self.layout.params:
            yield p.name, view(self.buffers[p.bucket], p)


def unshared(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """``buffers`` when each is host memory that nothing else references (no view of it is alive: not a model's
    parameter, not a function's packed weight), so the next push may be received into them; else ``[]``.

    Counts the references to each buffer's storage (``torch._C._storage_Use_Count``: the buffer itself and the
    storage object asked for make two); without that function nothing is reused."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None or not buffers or any(b.device.type != "cpu" for b in buffers):
        return []
    for b in buffers:
        storage = b.untyped_storage()
        if b.storage_offset() or count(storage._cdata) != 2:
            return []
    return list(buffers)


def view(buffer: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """The tensor of ``slot`` as a view of its bucket buffer."""
    raw = buffer[slot.offset: slot.offset + slot.nbytes]
    return raw.view(dtype_of(slot.dtype)).view(slot.shape)


def pack(named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, step: int,
         bucket_bytes: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Snapshot:
    """Copy ``(hf_name, tensor)`` pairs into fresh buckets on ``device`` (CPU for gloo and file pushes, the
    trainer's GPU for nccl; full tensors: DTensors are gathered with ``full_tensor()``). The result is independent
    of the source tensors; on CUDA the copies are complete when this returns (the caller's stream is synchronised),
    so a sender thread on another stream reads finished buckets. ``dtype``: floating-point tensors are cast to it
    as they are copied (the receiving engine's dtype: ``weightsync.push_dtype``); None keeps each tensor's own."""
    pairs = []
    for name, t in named_tensors:
        full = getattr(t, "full_tensor", None)
        t = full() if callable(full) else t
        pairs.append((name, t.detach()))
    layout = plan(((n, dtype if dtype is not None and t.is_floating_point() else t.dtype, tuple(t.shape))
                   for n, t in pairs), version=version, step=step, bucket_bytes=bucket_bytes)
    device = torch.device(device)
    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in layout.buckets]
    for (name, t), slot in zip(pairs, layout.params, strict=True):
        view(buffers[slot.bucket], slot).copy_(t)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return Snapshot(layout=layout, buffers=buffers)
