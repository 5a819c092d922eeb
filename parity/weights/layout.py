"""The packed byte stream a weight version travels as: where each tensor sits, and its buckets.

Invariants:
- Tensors lie back to back in plan order, each start aligned to `ALIGN_BYTES`, in one stream of
  `Layout.total_bytes`. Both sides derive the identical layout from the metadata alone (shape and
  dtype), so no offset ever goes on the wire.
- The stream moves as consecutive buckets of at most `bucket_bytes` (`Layout.buckets`), never one
  operation per tensor.
- `views` copies nothing: received tensors are views into the one buffer the stream landed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

# The bucket default lives with the config (one definition); re-exported for the data plane's users.
from parity.config.base import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from parity.v1 import common_pb2

if TYPE_CHECKING:
    import torch

ALIGN_BYTES = 16
_DTYPE_SIZES = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
SUPPORTED_DTYPES = frozenset(_DTYPE_SIZES)


class TransferError(RuntimeError):
    """A transfer failed: timeout, peer gone, or bad metadata."""


def dtype_size(dtype: str) -> int:
    try:
        return _DTYPE_SIZES[dtype]
    except KeyError:
        raise TransferError(f"dtype: unsupported {dtype!r} (one of {sorted(_DTYPE_SIZES)})") from None


@dataclass(frozen=True)
class Layout:
    """Where each tensor sits in the packed stream."""

    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    total_bytes: int

    @classmethod
    def of(cls, metas: Sequence[common_pb2.TensorMeta]) -> Layout:
        offsets, sizes, cursor = [], [], 0
        for meta in metas:
            count = 1
            for dim in meta.shape:
                count *= int(dim)
            cursor = -(-cursor // ALIGN_BYTES) * ALIGN_BYTES
            offsets.append(cursor)
            sizes.append(count * dtype_size(meta.dtype))
            cursor += sizes[-1]
        return cls(tuple(offsets), tuple(sizes), cursor)

    def buckets(self, bucket_bytes: int) -> list[tuple[int, int]]:
        if bucket_bytes <= 0:
            raise TransferError(f"bucket_bytes: must be > 0 (got {bucket_bytes})")
        return [
            (s, min(s + bucket_bytes, self.total_bytes)) for s in range(0, self.total_bytes, bucket_bytes)
        ]


def layout_of_tensors(tensors: Sequence[torch.Tensor]) -> Layout:
    """The layout of `tensors` as a plan would describe them (shape and dtype)."""
    metas = [
        common_pb2.TensorMeta(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch.")) for t in tensors
    ]
    return Layout.of(metas)


def views(buffer: torch.Tensor, metas: Sequence[common_pb2.TensorMeta], layout: Layout) -> list[torch.Tensor]:
    """Tensors of `metas` as views into a packed uint8 `buffer`."""
    import torch

    out = []
    for meta, offset, nbytes in zip(metas, layout.offsets, layout.nbytes, strict=True):
        dtype = getattr(torch, meta.dtype)
        out.append(buffer[offset : offset + nbytes].view(dtype).reshape(tuple(meta.shape)))
    return out


def pack(tensors: Sequence[torch.Tensor], layout: Layout, device: str = "cpu") -> torch.Tensor:
    """Copy tensors into one packed uint8 buffer following `layout`."""
    import torch

    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
    for tensor, offset, nbytes in zip(tensors, layout.offsets, layout.nbytes, strict=True):
        buffer[offset : offset + nbytes] = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return buffer


def packed_in_place(tensors: Sequence[torch.Tensor], layout: Layout) -> torch.Tensor | None:
    """The uint8 stream itself when `tensors` already lie in one buffer exactly as `layout` packs
    them (see `allocate_packed`); None otherwise. Sending it then copies nothing."""
    import torch

    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    base = first.storage_offset() * first.element_size() - layout.offsets[0]
    if base < 0 or base + layout.total_bytes > storage.nbytes():
        return None
    for tensor, offset in zip(tensors, layout.offsets, strict=True):
        if (
            not tensor.is_contiguous()
            or tensor.device != first.device
            or tensor.untyped_storage().data_ptr() != storage.data_ptr()
            or tensor.storage_offset() * tensor.element_size() != base + offset
        ):
            return None
    whole = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
    return whole[base : base + layout.total_bytes]


def allocate_packed(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One uint8 buffer in the stream's layout and, in it, copies of `tensors` as views. A sender
    whose tensors live there (a trainer's flattened parameters) sends with no packing copy."""
    layout = layout_of_tensors(tensors)
    metas = [
        common_pb2.TensorMeta(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch.")) for t in tensors
    ]
    import torch

    device = tensors[0].device if tensors else "cpu"
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
    placed = views(buffer, metas, layout)
    for view, tensor in zip(placed, tensors, strict=True):
        view.copy_(tensor.detach())
    return buffer, placed
