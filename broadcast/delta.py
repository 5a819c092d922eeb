"""Delta updates: what a version must send to workers that already serve the version before it.

With `broadcast.delta_updates` on, a publish whose every epoch member verifiably serves version
v-1 sends only the tensors whose WSUM64 checksum differs from v-1's, each with every tensor of its
group: a whole transformer block (`model.layers.3.*`) for tensors inside one, else its own module
(`model.embed_tokens`, `model.norm`). vLLM fuses tensors of one block into one parameter (q/k/v into
qkv_proj, gate/up into gate_up_proj, every expert into one MoE weight) and its in-place reload
processes a fused parameter only from all of its parts, so parts never travel alone; a block is the
smallest unit that holds for every architecture. The plan says `base_version` = v-1; a worker that
does not serve exactly that refuses it. Catch-ups and late joiners always get whole versions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from parity.v1 import common_pb2

_BLOCK = re.compile(r"^(.*?\.(?:layers|layer|h|blocks)\.\d+)\.")


def module_group(name: str) -> str:
    """The group a tensor travels with: its transformer block, else its module."""
    block = _BLOCK.match(name)
    return block.group(1) if block else name.rsplit(".", 1)[0]


def changed_tensors(
    previous: Sequence[common_pb2.TensorMeta], current: Sequence[common_pb2.TensorMeta]
) -> list[common_pb2.TensorMeta]:
    """`current`'s tensors (in its order) that differ from `previous` by checksum, shape or dtype,
    with every other tensor of their module groups."""
    before = {m.name: (m.checksum, tuple(m.shape), m.dtype) for m in previous}
    dirty = {
        module_group(m.name) for m in current if before.get(m.name) != (m.checksum, tuple(m.shape), m.dtype)
    }
    return [m for m in current if module_group(m.name) in dirty]


def delta_base(previous_version: int, previous_committed: bool, member_versions: Iterable[int | None]) -> int:
    """The version a delta may be built against, or 0 for a whole version: the previous version,
    when it committed and every member of the epoch (at least one) verifiably serves it (None: a
    member whose version is not verified)."""
    versions = list(member_versions)
    if previous_version < 1 or not previous_committed or not versions:
        return 0
    return previous_version if all(v == previous_version for v in versions) else 0
