"""Checksumming a packed stream while it arrives, so verification does not wait for the last byte.

Invariants:
- A received tensor counts as intact only when its WSUM64 (`checksum`) equals the plan's value;
  `mismatched` names every tensor that does not, and the receiver then keeps its old weights.
- No byte is read twice: in host memory each bucket's share of every tensor is summed as soon as
  the bucket lands (`checksum.checksum_update`), so the tail after the last bucket is one bucket's
  worth of work. On a GPU a tensor is summed whole once its last byte has arrived.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from parity.v1 import common_pb2
from parity.weights.layout import Layout, views

if TYPE_CHECKING:
    import torch


class StreamVerifier:
    """Checksums a packed stream as it arrives (pass `advance` as `progress`)."""

    def __init__(self, buffer: torch.Tensor, metas: Sequence[common_pb2.TensorMeta]) -> None:
        self.metas = list(metas)
        self.layout = Layout.of(self.metas)
        self.tensors = views(buffer, self.metas, self.layout)
        self.checksums: list[int] = []  # finished tensors, in plan order
        self._host = None if buffer.is_cuda else buffer.numpy()
        self._partial = 0  # the next tensor's checksum over its first `_done` bytes (host memory)
        self._done = 0

    def advance(self, end: int) -> None:
        """Bytes [0, end) of the stream have arrived."""
        from parity.weights.checksum import checksum_update, tensor_checksum

        layout = self.layout
        while len(self.checksums) < len(self.metas):
            i = len(self.checksums)
            offset, nbytes = layout.offsets[i], layout.nbytes[i]
            arrived = min(end, offset + nbytes) - offset
            if self._host is None:
                if arrived < nbytes:
                    return
                self.checksums.append(tensor_checksum(self.tensors[i]))
                continue
            upto = nbytes if arrived >= nbytes else max(0, arrived - arrived % 8)
            if upto > self._done:
                lo = offset + self._done
                self._partial = checksum_update(self._partial, self._host[lo : offset + upto], self._done)
                self._done = upto
            if upto < nbytes:
                return
            self.checksums.append(self._partial)
            self._partial, self._done = 0, 0

    def mismatched(self) -> list[str]:
        """Names whose checksum differs from the metadata (call after the last `advance`)."""
        self.advance(self.layout.total_bytes)
        return [m.name for m, c in zip(self.metas, self.checksums, strict=True) if c != m.checksum]
