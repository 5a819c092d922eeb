"""Flattened parameters: the policy's weights live in one buffer, laid out as the weight transport
packs a version, so publishing sends that buffer bucket by bucket with no packing copy.

Invariants:
- Parameter objects keep their identity (only `.data` moves), so the optimizer, hooks and tied
  weights are unaffected; gradients stay separate tensors.
- The order is `named_parameters()` order, the order the publisher describes and sends tensors in;
  `parity.weights.layout.packed_in_place` recognises the layout and falls back to packing otherwise.
- Only for a model that is whole on one device. Sharded (FSDP2 / DTensor) parameters are gathered
  bucket by bucket at publish time and are left alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def flatten_parameters(module: torch.nn.Module) -> torch.Tensor | None:
    """Move every parameter of `module` into one packed uint8 buffer (returned); None when the
    parameters are sharded or spread over devices, which are then left as they are."""
    import torch

    from parity.weights.layout import allocate_packed

    params = [param for _, param in module.named_parameters()]
    if not params:
        return None
    if any(hasattr(p, "full_tensor") for p in params) or len({p.device for p in params}) > 1:
        return None
    buffer, placed = allocate_packed([p.detach() for p in params])
    with torch.no_grad():
        for param, view in zip(params, placed, strict=True):
            param.data = view
    return buffer
