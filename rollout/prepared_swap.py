"""A prepared swap: build a verified version's kernel form while the engine generates, and make the
pause a copy and a rebind.

On CPU, vLLM's in-place `reload_weights` re-runs every reloaded layer's weight processing (the oneDNN
or sgl prepacking of each linear layer, the lm_head's prepacked copy), and all of it happens while
generation is paused: ~0.65 s for SmolLM2-135M on 2 cores, 2x the raw transfer of its bytes.
Here the same vLLM reload runs on a *shadow* of the model, on the worker's staging thread, while the
engine core keeps stepping:

  prepare (generating):  every module copied shallowly (own parameter/buffer/child dicts, tensors
                         cloned, everything else shared), vLLM's layerwise reload run on that copy
                         with the staged tensors, the embedding-derived copies re-derived there.
  apply (paused):        for every module, the shadow's tensors copied into the live tensors'
                         own storage (as vLLM's reload does, so any reference to them stays valid)
                         and the attributes processing replaced (the prepacked GEMM closures)
                         rebound. No weight processing runs in the pause.

The live model is never written before `apply`. A preparation that raises leaves nothing behind and
the caller falls back to the in-place reload. Used on CPU only: on GPU the in-place reload is cheap
and a shadow would double the weights' device memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_TREE_KEYS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
_MISSING = object()


@dataclass
class PreparedSwap:
    """Pairs of (live module, shadow module) whose shadow holds the new version, processed."""

    pairs: list[tuple[torch.nn.Module, torch.nn.Module]]

    def apply(self) -> int:
        """While paused: move the shadow's state into the live modules. Returns the bytes copied."""
        copied, done = 0, set()  # a tied tensor is held by two modules: copied once
        for live, shadow in self.pairs:
            for kind in ("_parameters", "_buffers"):
                live_tensors, new_tensors = live.__dict__[kind], shadow.__dict__[kind]
                for name, new in new_tensors.items():
                    old = live_tensors.get(name)
                    if new is None or old is new:
                        continue
                    if old is not None and old.shape == new.shape and old.dtype == new.dtype:
                        if id(new) not in done:
                            old.data.copy_(new)
                            copied += new.numel() * new.element_size()
                            done.add(id(new))
                    else:  # processing changed its form (an emptied weight, a repacked one)
                        live_tensors[name] = new
            live_attrs, new_attrs = live.__dict__, shadow.__dict__
            for key, value in new_attrs.items():
                if key not in _TREE_KEYS and live_attrs.get(key, _MISSING) is not value:
                    live_attrs[key] = value
            for key in [k for k in live_attrs if k not in new_attrs and k not in _TREE_KEYS]:
                del live_attrs[key]  # processing removed it (e.g. a "processed already" flag)
        for _, shadow in self.pairs:  # freed now, not at the next garbage collection: its tensors
            shadow.__dict__.clear()  # and loaders bound to it form cycles (vLLM's own layout)
        self.pairs = []  # what the live modules took from the shadows lives on there
        return copied


def _clone_tensor(tensor: torch.Tensor, memo: dict[int, torch.Tensor]) -> torch.Tensor:
    """A tensor of the same class (vLLM's parameter subclasses) and attributes, with its own storage;
    a tensor registered in two modules (tied weights) is cloned once, so the shadow ties them too."""
    import torch

    if id(tensor) in memo:
        return memo[id(tensor)]
    data = tensor.detach().clone()
    if isinstance(tensor, torch.nn.Parameter):
        clone = torch.Tensor._make_subclass(type(tensor), data, tensor.requires_grad)
    else:
        clone = data
    clone.__dict__.update(tensor.__dict__)  # weight_loader, output_dim, ... (vLLM's loading metadata)
    memo[id(tensor)] = clone
    return clone


def _meta_for(meta: torch.Tensor, live: torch.nn.Module, shadow: torch.nn.Module) -> torch.Tensor:
    """The shadow's own copy of one of `live`'s recorded checkpoint-form meta tensors. vLLM's reload
    writes into these records (it binds their weight loaders to the layer and wraps them with its
    deferred-processing loader), so a shadow that shared them would leave them bound to itself and
    the next shadow's loads would go to this one. The copy's loaders are unwrapped and bound to
    `shadow`."""
    from types import MethodType

    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    copy = meta.data.to("meta")
    copy.__class__ = meta.__class__
    attrs = dict(meta.__dict__)
    for key, value in attrs.items():
        while getattr(value, "__name__", "") == "online_process_loader":  # vLLM's deferred loader
            value = value.__wrapped__
        if isinstance(value, MethodType) and (value.__self__ is live or value.__self__ is layer_ref_sentinel):
            value = value.__func__.__get__(shadow)
        attrs[key] = value
    copy.__dict__ = attrs
    return copy


def shadow_of(
    model: torch.nn.Module,
) -> tuple[torch.nn.Module, list[tuple[torch.nn.Module, torch.nn.Module]]]:
    """A copy of `model` that shares no tensor storage and no parameter, buffer or child dict with it
    (a module that appears twice, such as a tied lm_head, is copied once), and the (live, shadow)
    pairs of its modules."""
    pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []
    return _copy_module(model, {}, {}, pairs), pairs


def _copy_module(
    module: torch.nn.Module,
    memo: dict[int, torch.nn.Module],
    tensors: dict[int, torch.Tensor],
    pairs: list[tuple[torch.nn.Module, torch.nn.Module]],
) -> torch.nn.Module:
    # a plain recursive function, not a closure: a self-referencing closure is a reference cycle that
    # would keep every shadow alive until the next garbage collection
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    if id(module) in memo:
        return memo[id(module)]
    shadow = module.__class__.__new__(module.__class__)
    shadow.__dict__.update(module.__dict__)
    memo[id(module)] = shadow
    shadow.__dict__["_parameters"] = {
        k: None if p is None else _clone_tensor(p, tensors) for k, p in module._parameters.items()
    }
    shadow.__dict__["_buffers"] = {
        k: None if b is None else _clone_tensor(b, tensors) for k, b in module._buffers.items()
    }
    shadow.__dict__["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    shadow.__dict__["_modules"] = {
        k: None if child is None else _copy_module(child, memo, tensors, pairs)
        for k, child in module._modules.items()
    }
    live_info, shadow_info = get_layerwise_info(module), get_layerwise_info(shadow)
    params, buffers = live_info.restore_metadata  # the checkpoint form to load into
    shadow_info.restore_metadata = (
        {k: _meta_for(t, module, shadow) for k, t in params.items()},
        {k: _meta_for(t, module, shadow) for k, t in buffers.items()},
    )
    shadow_info.restore_device = live_info.restore_device
    pairs.append((module, shadow))
    return shadow


def prepare(
    vllm_config,
    model: torch.nn.Module,
    named: list[tuple[str, torch.Tensor]],
    snapshot: Callable[[torch.nn.Module], object],
    refresh: Callable[[torch.nn.Module, object], object],
) -> PreparedSwap:
    """Load and process `named` (checkpoint-format tensors) into a shadow of `model` with vLLM's own
    layerwise reload, then `refresh(shadow, snapshot(shadow) taken before the reload)`: re-derive
    what vLLM keeps beside the weights and did not process itself. The live model is only read."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    shadow, pairs = shadow_of(model)
    try:
        with torch.no_grad(), set_current_vllm_config(vllm_config):
            before = snapshot(shadow)
            reload_weights(vllm_config, shadow, iter(named), None, True)
            refresh(shadow, before)
    finally:
        # vLLM keeps each module's reload record in a dict keyed weakly by the module; the shadow's
        # records hold loaders bound to the shadow (and its deferred loaders hold the records), so
        # left there they would keep every shadow (its prepacked weights: ~0.8 GB for SmolLM2)
        # alive for good, and merely dropped they would wait for a garbage collection
        for _, module in pairs:
            info = LAYERWISE_INFO.pop(module, None)
            if info is not None:
                info.restore_metadata = ({}, {})
                info.reset()
    return PreparedSwap(pairs=pairs)
