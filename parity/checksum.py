"""WSUM64: a cheap, device-agnostic checksum over a tensor's raw bytes.

Definition. Read the tensor's bytes (C-contiguous order) as little-endian 64-bit words w_0..w_{n-1},
zero-padding the last word. Split them into chunks of C = 2**20 words; word i = c*C + j. Then

    WSUM64 = sum_i (2*c + 1) * (2*j + 1) * w_i   (mod 2**64)

Invariants this gives us:
- Every weight is odd, hence invertible mod 2**64: changing any single word always changes the sum,
  and swapping two differing words at positions with different weights does too (position matters).
- Integer addition mod 2**64 is associative, so the value is identical on CPU and CUDA, whatever the
  reduction order or chunking (torch's int64 arithmetic wraps).
- It is one multiply-add per 8 bytes, computed in chunks against a cached odd-weight vector, so it runs
  at memory bandwidth: cheap enough for every update (bench/weight_sync.py reports ms per 100 MB).

It is an integrity check against transport bugs and truncation, not a cryptographic hash; the token
guards who may publish.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from parity.v1 import common_pb2

if TYPE_CHECKING:
    import torch

MASK64 = (1 << 64) - 1
CHUNK_WORDS = 1 << 20  # 8 MiB of words per step: bounded temporary memory
_weights_cache: dict[str, torch.Tensor] = {}


def _odd_weights(device: torch.device) -> torch.Tensor:
    import torch

    key = str(device)
    weights = _weights_cache.get(key)
    if weights is None:
        weights = torch.arange(CHUNK_WORDS, dtype=torch.int64, device=device) * 2 + 1
        _weights_cache[key] = weights
    return weights


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (no copy when already contiguous)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8)


def _words(byte_view: torch.Tensor) -> torch.Tensor:
    """uint8 -> int64 words, zero-padding the tail; copies only if misaligned or padded."""
    import torch

    n_bytes = byte_view.numel()
    if n_bytes % 8:
        padded = torch.zeros(n_bytes + 8 - n_bytes % 8, dtype=torch.uint8, device=byte_view.device)
        padded[:n_bytes] = byte_view
        byte_view = padded
    try:
        return byte_view.view(torch.int64)
    except RuntimeError:  # storage offset not 8-byte aligned
        return byte_view.clone().view(torch.int64)


def checksum_bytes(byte_view: torch.Tensor) -> int:
    """WSUM64 of a flat uint8 tensor."""
    import torch

    words = _words(byte_view)
    weights = _odd_weights(words.device)
    total = 0
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start : start + CHUNK_WORDS]
        chunk_weight = 2 * (start // CHUNK_WORDS) + 1
        if chunk.is_cuda:  # no integer dot on CUDA; elementwise is fast there
            part = int((chunk * weights[: chunk.numel()]).sum().item())
        else:  # one pass, no temporary: 30 ms per 100 MB on one core
            part = int(torch.dot(chunk, weights[: chunk.numel()]).item())
        total = (total + chunk_weight * part) & MASK64
    return total & MASK64


def tensor_checksum(tensor: torch.Tensor) -> int:
    """WSUM64 of `tensor`'s raw bytes as an unsigned 64-bit python int (CPU or CUDA)."""
    return checksum_bytes(_as_bytes(tensor))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32"."""
    return str(dtype).removeprefix("torch.")


def describe(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[common_pb2.TensorMeta]:
    """Metadata (name, shape, dtype, WSUM64) for each tensor, in the given order."""
    return [
        common_pb2.TensorMeta(
            name=name,
            shape=list(tensor.shape),
            dtype=dtype_name(tensor.dtype),
            checksum=tensor_checksum(tensor),
        )
        for name, tensor in named_tensors
    ]


def mismatched(metas: Sequence[common_pb2.TensorMeta], tensors: Sequence[torch.Tensor]) -> list[str]:
    """Names of tensors whose shape, dtype or checksum differ from `metas` (same order)."""
    if len(metas) != len(tensors):
        extra = [m.name for m in metas[len(tensors) :]] or [f"<extra tensor #{len(metas)}>"]
        bad = [m.name for m, t in zip(metas, tensors, strict=False) if not _matches(m, t)]
        return bad + extra
    return [m.name for m, t in zip(metas, tensors, strict=True) if not _matches(m, t)]


def _matches(meta: common_pb2.TensorMeta, tensor: torch.Tensor) -> bool:
    return (
        list(meta.shape) == list(tensor.shape)
        and meta.dtype == dtype_name(tensor.dtype)
        and meta.checksum == tensor_checksum(tensor)
    )
