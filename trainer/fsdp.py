"""Data parallelism inside the trainer: process group, FSDP2 sharding, full weights from shards.

Invariants:
- One process per device; the backend is NCCL on CUDA and gloo on CPU; every collective has the
  group's timeout (`trainer.dist_timeout_s`), so a lost rank is an error, never a hang.
- `fully_shard` wraps each decoder layer and the final norm, then the CompletionScorer as the root:
  the root's group holds the embeddings and lm_head with float32 params (the head stays fp32); the
  layers and the final norm get the precision policy (bf16 params, fp32 gradient reduction in bf16
  mode). So N ranks compute the one-rank bf16 forward bit for bit (tests/test_trainer_fsdp.py).
- Each rank's loss is already divided by the *global* token (or sequence) count, so gradients are
  summed across ranks (divide factor 1), not averaged: N ranks then give the 1-rank gradient.
- Parameters are DTensors after sharding; `full_parameters` and `weight_history.weight_buckets`
  all-gather them (collective). On rank 0 of a multi-rank service every such gather is announced to
  the other ranks first (trainer/multirank.py), so that they join the all-gathers in the same order.
- Every rank runs the same number of micro-batches of each kind (`align_micro_batches`); a rank
  with fewer runs `idle_micro_batch`es, so the all-gathers and reduce-scatters always pair up.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from parity.sampling import SamplingTransform
from trainer.policy import SequenceInput, token_logprobs
from trainer.precision import mixed_precision_policy

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def world() -> tuple[int, int]:
    """(rank, world size) from the torchrun environment; (0, 1) outside it."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_process_group(device: torch.device, timeout_s: float) -> None:
    """Join the torchrun group (env://) unless already in one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    log.info("rank %d/%d joined (%s)", dist.get_rank(), dist.get_world_size(), backend)


def shard_scorer(scorer, precision: str, reshard_after_forward: bool = True):
    """FSDP2 over the default process group; returns the same (now sharded) scorer."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    decoder = getattr(scorer.lm, scorer.lm.base_model_prefix)
    for layer in decoder.layers:
        fully_shard(
            layer, mp_policy=mixed_precision_policy(precision), reshard_after_forward=reshard_after_forward
        )
    norm = getattr(decoder, "norm", None)
    if norm is not None:
        # The final norm computes in the layers' precision, as on one rank (precision.bf16_decoder)
        # and in a bf16 engine: in the root's float32 it would skip a bf16 rounding of its output.
        fully_shard(norm, mp_policy=mixed_precision_policy(precision))
    fully_shard(scorer, mp_policy=mixed_precision_policy(precision, for_head=True))
    scorer.sharded = True
    for module in scorer.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM reductions (gloo has no PREMUL_SUM; NCCL's zero-copy path wants SUM too).
            module.set_force_sum_reduction_for_comms(True)
    return scorer


def reshard_all(module) -> None:
    """Reshard every FSDP2 group of `module`. FSDP2 leaves the root group (embeddings, lm_head)
    unsharded after a forward, expecting the backward to use it; after a forward without
    gradient the module would then expose unsharded parameters with no `.grad`, and a gradient-norm
    clip over `module.parameters()` would silently leave that group out."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def full_parameters(module) -> dict[str, torch.Tensor]:
    """name -> full (unsharded) parameter on this rank's device (all-gathers DTensors)."""
    out = {}
    for name, param in module.named_parameters():
        tensor = param.detach()
        out[name] = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return out


def all_reduce_sum(value: float, device: torch.device) -> float:
    """Sum of a float over the ranks (itself when not distributed)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor[0])


def shard_of(items: list, rank: int, world_size: int) -> list:
    """This rank's share of a batch: every world_size-th item from `rank` (balanced lengths)."""
    return items[rank::world_size]


def align_micro_batches(chunks: list[list[Any]], device: torch.device) -> list[list[Any]]:
    """`chunks` padded with empty micro-batches to the most any rank has (a collective when
    distributed; `chunks` itself otherwise). An empty micro-batch is run as `idle_micro_batch`."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return chunks
    count = torch.tensor([len(chunks)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return chunks + [[] for _ in range(int(count.item()) - len(chunks))]


def idle_micro_batch(scorer, ref_model, train: bool) -> None:
    """The collectives of a micro-batch with no data: a one-token forward of `scorer` (and of
    `ref_model` when there is one) and, with `train`, the backward of loss x 0 (zero gradients,
    summed into the other ranks' by the reduce-scatter)."""
    import torch

    dummy = [SequenceInput((0,), (0,), SamplingTransform())]
    with torch.set_grad_enabled(train):
        logprobs_T, _ = token_logprobs(scorer, dummy, with_entropy=False)
    if ref_model is not None:
        with torch.no_grad():
            token_logprobs(ref_model, dummy, with_entropy=False)
    if train:
        (logprobs_T.sum() * 0.0).backward()
