"""Building a trainer's models: device, policy (sharded on several ranks), optimizer, frozen copies.

Invariants:
- The seed is set before anything random is created, so two trainers of one config start equal.
- TF32 is off process-wide before the first matmul (trainer/precision.py).
- On one rank the policy's parameters are flattened into one buffer (publishing then sends them
  with no packing copy); on several, FSDP2 shards every decoder layer and the scorer's root.
- `trainer.compile` compiles the decoder layers of the policy and of every frozen copy
  (trainer/compiled.py) before any sharding.
- The frozen copies (reference model for the KL penalty; `old_model` for recompute and own-version
  scoring) never train. On several ranks only rank 0 scores own versions (it holds the whole
  batch), with an unsharded copy of its own; recompute shards its copy like the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.config.base import ConfigError
from trainer import fsdp
from trainer import precision as numerics
from trainer.compiled import compile_decoder_layers
from trainer.device import resolve_device
from trainer.flat_params import flatten_parameters
from trainer.freeze import freeze_parameters
from trainer.head import HeadOptions
from trainer.policy import load_model, scorer_for

if TYPE_CHECKING:
    from parity.config.trainer import TrainerConfig


@dataclass
class TrainingModels:
    device: Any
    rank: int
    world_size: int
    distributed: bool
    model_dir: Path
    model: Any  # the HF model whose parameters train
    scorer: Any  # the model with its fp32 head: what the step runs
    optimizer: Any
    scheduler: Any
    ref_model: Any | None
    old_model: Any | None


def build_models(config: TrainerConfig, seed: int, model_name: str) -> TrainingModels:
    import torch

    from parity import models

    cfg = config
    torch.manual_seed(seed)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    numerics.disable_tf32()
    device = resolve_device(cfg.device)
    rank, world_size = fsdp.world()
    distributed = world_size > 1
    if distributed and cfg.old_logprobs == "recompute":  # under a torchrun of its own (Kubernetes)
        raise ConfigError(
            f"trainer.old_logprobs: recompute is not supported with more than one trainer rank "
            f"(WORLD_SIZE={world_size}); use old_logprobs=behaviour"
        )
    if distributed:
        fsdp.init_process_group(device, cfg.dist_timeout_s)
    model_dir = models.resolve(model_name)
    model = load_model(model_dir, cfg.dtype, device, packing=cfg.packing, share_prompts=cfg.share_prompts)
    freeze_parameters(model, cfg.freeze)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile != "off":
        compile_decoder_layers(model, cfg.compile)
    if not distributed:
        flatten_parameters(model)
    head = head_options(cfg, device)
    scorer = scorer_for(model, cfg.precision, sharded=distributed, head=head)
    if distributed:
        fsdp.shard_scorer(scorer, cfg.precision)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(0.9, 0.999),
        eps=1e-8,
    )
    warmup = cfg.lr_warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )

    def frozen_copy(shard: bool):
        copy = load_model(model_dir, cfg.dtype, device, packing=cfg.packing, share_prompts=cfg.share_prompts)
        copy.eval()
        for param in copy.parameters():
            param.requires_grad_(False)
        if cfg.compile != "off":
            compile_decoder_layers(copy, cfg.compile)
        copy_scorer = scorer_for(copy, cfg.precision, sharded=distributed and shard, head=head)
        if distributed and shard:
            fsdp.shard_scorer(copy_scorer, cfg.precision)
        return copy_scorer

    ref_model = frozen_copy(shard=True) if cfg.kl_coef > 0 else None
    own_version = cfg.own_version_groups > 0 and rank == 0
    recompute = cfg.old_logprobs == "recompute"
    old_model = frozen_copy(shard=recompute) if recompute or own_version else None
    return TrainingModels(
        device,
        rank,
        world_size,
        distributed,
        model_dir,
        model,
        scorer,
        optimizer,
        scheduler,
        ref_model,
        old_model,
    )


def head_options(cfg: TrainerConfig, device) -> HeadOptions:
    """The head's chunking and backward dtype (`auto`: bf16 GEMMs only for bf16 runs on CUDA)."""
    grad_dtype = cfg.head_grad_dtype
    if grad_dtype == "auto":
        grad_dtype = "bfloat16" if cfg.precision == "bf16" and device.type == "cuda" else "float32"
    return HeadOptions(chunk_tokens=cfg.head_chunk_tokens, grad_dtype=grad_dtype)
