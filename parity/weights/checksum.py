"""WSUM64: a cheap, device-agnostic checksum over a tensor's raw bytes.

Definition. Read the tensor's bytes (C-contiguous order) as little-endian 64-bit words w_0..w_{n-1},
zero-padding the last word. Split them into chunks of C = 2**20 words; word i = c*C + j. Then

    WSUM64 = sum_i (2*c + 1) * (2*j + 1) * w_i   (mod 2**64)

Invariants this gives us:
- Every weight is odd, hence invertible mod 2**64: changing any single word always changes the sum,
  and swapping two differing words at positions with different weights does too (position matters).
- Integer addition mod 2**64 is associative, so the value is identical on CPU and CUDA, whatever the
  reduction order or chunking (torch's int64 arithmetic wraps).
- On CUDA it is one multiply-add per 8 bytes against a cached odd-weight vector. On CPU there is no
  vectorised 64-bit integer dot, so it is computed from additions only, as S = sum w and T = sum j*w
  over each run of words: in one pass by a small compiled kernel (parity/weights/wsum_kernel.c) where it is
  built, else in numpy from the run's row sums and column sums as rows of `ROW_WORDS` (T = ROW_WORDS
  * sum_r r*rowsum_r + sum_k k*colsum_k), a block of rows at a time so that the second reading hits
  the core's cache. bench/weight_sync.py reports ms per 100 MB.
- It can be accumulated piece by piece (`checksum_update`): a receiver sums each bucket's share of a
  tensor as soon as it lands instead of reading the whole tensor again after its last byte.

It is an integrity check against transport bugs and truncation, not a cryptographic hash; the token
guards who may publish.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from parity.v1 import common_pb2
from parity.weights.wsum_kernel import run_sums

if TYPE_CHECKING:
    import numpy as np
    import torch

MASK64 = (1 << 64) - 1
CHUNK_WORDS = 1 << 20  # 8 MiB of words per step: bounded temporary memory
ROW_WORDS = 1024  # CPU: a run of words is summed as rows of 8 KiB
BLOCK_ROWS = 64  # CPU: 512 KiB of rows at a time, so the column pass re-reads them from cache
PIECE_BYTES = 16 << 20  # CPU: a tensor is summed in pieces of 16 MiB (a multiple of 8), in parallel
CHECKSUM_THREADS = 4  # CPU: at most this many threads
_weights_cache: dict[str, torch.Tensor] = {}
_checksum_pool = None  # the ThreadPoolExecutor `checksums` uses, made on first need


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
    if not byte_view.is_cuda:
        return checksum_update(0, byte_view.numpy(), 0)
    words = _words(byte_view)
    weights = _odd_weights(words.device)
    total = 0
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start : start + CHUNK_WORDS]
        chunk_weight = 2 * (start // CHUNK_WORDS) + 1
        part = int((chunk * weights[: chunk.numel()]).sum().item())  # no integer dot on CUDA
        total = (total + chunk_weight * part) & MASK64
    return total & MASK64


def checksum_update(total: int, data: np.ndarray, start: int) -> int:
    """`total` (a tensor's WSUM64 over its bytes before `start`) plus the share of `data`, the
    tensor's bytes [start, start + len(data)), a flat uint8 array in host memory. `start` must be a
    multiple of 8; only the tensor's last piece may have a length that is not (it is zero-padded, as
    the definition pads the last word). Summing a tensor piece by piece gives its `tensor_checksum`."""
    import numpy as np

    if start % 8:
        raise ValueError(f"start: {start} is not a multiple of 8 bytes")
    full = data.size - data.size % 8
    words = data[:full].view(np.uint64)
    index, pos = start // 8, 0
    while pos < words.size:
        chunk, j0 = divmod(index + pos, CHUNK_WORDS)
        take = min(words.size - pos, CHUNK_WORDS - j0)
        s, t = _sums(words[pos : pos + take])
        # sum over the run of (2*c + 1) * (2*(j0 + j) + 1) * w_j
        total += (2 * chunk + 1) * (2 * (t + j0 * s) + s)
        pos += take
    if full < data.size:  # the last, partial word, zero-padded (no copy of the rest)
        last = np.zeros(8, dtype=np.uint8)
        last[: data.size - full] = data[full:]
        chunk, j = divmod(index + words.size, CHUNK_WORDS)
        total += (2 * chunk + 1) * (2 * j + 1) * int(last.view(np.uint64)[0])
    return total & MASK64


def _sums(words: np.ndarray) -> tuple[int, int]:
    """(S, T) = (sum w_j, sum j * w_j) mod 2**64 over uint64 `words`, j counted from 0: in one pass
    by the compiled kernel (parity/weights/wsum_kernel.py) where it is built, by numpy's two otherwise."""
    kernel = run_sums()
    return kernel(words) if kernel is not None else run_sums_numpy(words)


def run_sums_numpy(words: np.ndarray) -> tuple[int, int]:
    """`_sums` by additions only in numpy: rows of ROW_WORDS, BLOCK_ROWS rows at a time (row sums,
    then column sums from cache)."""
    import numpy as np

    count = words.size
    full = count - count % ROW_WORDS
    rows = full // ROW_WORDS
    s = t = 0
    if rows:
        matrix = words[:full].reshape(rows, ROW_WORDS)
        row_sums = np.empty(rows, dtype=np.uint64)
        col_sums = np.zeros(ROW_WORDS, dtype=np.uint64)
        block_cols = np.empty(ROW_WORDS, dtype=np.uint64)
        for r0 in range(0, rows, BLOCK_ROWS):
            block = matrix[r0 : r0 + BLOCK_ROWS]
            np.add.reduce(block, axis=1, out=row_sums[r0 : r0 + block.shape[0]])
            np.add.reduce(block, axis=0, out=block_cols)
            np.add(col_sums, block_cols, out=col_sums)
        s = int(row_sums.sum())
        t = int(np.dot(np.arange(rows, dtype=np.uint64), row_sums)) * ROW_WORDS
        t += int(np.dot(np.arange(ROW_WORDS, dtype=np.uint64), col_sums))
    if full < count:  # the last partial row
        tail = words[full:]
        s += int(tail.sum())
        t += int(np.dot(np.arange(full, count, dtype=np.uint64), tail))
    return s & MASK64, t & MASK64


def tensor_checksum(tensor: torch.Tensor) -> int:
    """WSUM64 of `tensor`'s raw bytes as an unsigned 64-bit python int (CPU or CUDA)."""
    return checksum_bytes(_as_bytes(tensor))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32"."""
    return str(dtype).removeprefix("torch.")


def _piece_checksum(piece: tuple[np.ndarray, int]) -> int:
    data, start = piece
    return checksum_update(0, data, start)


def checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """`tensor_checksum` of each tensor. Host tensors are cut into pieces of at most PIECE_BYTES and
    summed on up to CHECKSUM_THREADS threads, no more than the cores this process may use: one core
    reads memory well below what the machine can. numpy's reductions release the GIL, and WSUM64 is
    a sum, so a tensor's pieces add up to its value. CUDA tensors are summed on their device."""
    pieces: list[tuple[np.ndarray, int]] = []
    owner: list[int] = []
    values = [0] * len(tensors)
    for i, tensor in enumerate(tensors):
        byte_view = _as_bytes(tensor)
        if byte_view.is_cuda:
            values[i] = checksum_bytes(byte_view)
            continue
        data = byte_view.numpy()
        for start in range(0, max(data.size, 1), PIECE_BYTES):
            pieces.append((data[start : start + PIECE_BYTES], start))
            owner.append(i)
    pool = _pool() if len(pieces) > 1 else None
    sums = list(pool.map(_piece_checksum, pieces)) if pool else [_piece_checksum(p) for p in pieces]
    for i, value in zip(owner, sums, strict=True):
        values[i] = (values[i] + value) & MASK64
    return values


def _pool():
    """This process's checksum threads (CHECKSUM_THREADS, no more than its cores), made once; None
    on one core."""
    from concurrent.futures import ThreadPoolExecutor

    global _checksum_pool
    threads = min(CHECKSUM_THREADS, len(os.sched_getaffinity(0)))
    if _checksum_pool is None and threads > 1:
        _checksum_pool = ThreadPoolExecutor(threads, thread_name_prefix="parity-checksum")
    return _checksum_pool


def describe(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[common_pb2.TensorMeta]:
    """Metadata (name, shape, dtype, WSUM64) for each tensor, in the given order."""
    named = list(named_tensors)
    values = checksums([tensor for _, tensor in named])
    return [
        common_pb2.TensorMeta(
            name=name,
            shape=list(tensor.shape),
            dtype=dtype_name(tensor.dtype),
            checksum=value,
        )
        for (name, tensor), value in zip(named, values, strict=True)
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
