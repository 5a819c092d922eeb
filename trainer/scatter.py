"""Rank 0 -> ranks: a step's sequences; ranks -> rank 0: what their micro-batches measured.

Everything crosses as tensors through torch.distributed collectives of the trainer's group (gloo
on CPU, NCCL on CUDA; the group's timeout is `trainer.dist_timeout_s`). Nothing is pickled: no
`broadcast_object_list` / `scatter_object_list`, whose payloads are pickles.

Sequences (`scatter_sequences`), one flat int64 and one flat float64 tensor per rank:

    ints   = [S, then per sequence: prompt_len, completion_len, has_mask, trainable, group_index, top_k]
             ‖ per sequence: prompt ids ‖ completion ids ‖ loss mask (one 0/1 per completion token)
               ‖ token versions ‖ token context versions (one per model token)
    floats = per sequence: advantage, temperature, top_p ‖ per sequence: rollout logprobs (model tokens)

  The sizes of every rank's pair are broadcast first ([world, 2] int64), then both tensors are
  scattered, zero-padded to the largest; each rank cuts its own back to size. float64 carries the
  float32 logprobs and the Python-float advantages exactly.

Measurements (`gather_stats`): each rank flattens its StepStats into one float64 tensor (the
per-token fields in `stats.tensor_fields()` order, then the scalars loss, non-finite count and
forward tokens) with an int64 vector of the pieces' lengths; the length vectors are all-gathered,
the payloads gathered to rank 0 (zero-padded), and rank 0 joins one StepStats for the whole batch
(host tensors). Loss is the sum over the ranks that trained; NaN when none did.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from parity.sampling import SamplingTransform
from trainer.policy import SequenceInput
from trainer.prepare import ScoredSequence

if TYPE_CHECKING:
    import torch


from trainer.stats import OPTIONAL_FIELDS, SCALAR_FIELDS, StepStats, tensor_fields

_SCALARS = len(SCALAR_FIELDS)
HEADER = 6  # per sequence: prompt_len, completion_len, has_mask, trainable, group_index, top_k
_DTYPES = {"lags": "long", "clean": "bool"}  # the others travel and arrive as float32


def encode_sequences(sequences: list[ScoredSequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [..], float64 [..]) host tensors of `sequences` (layout in the module docstring)."""
    import torch

    header: list[int] = [len(sequences)]
    tokens: list[int] = []
    scalars: list[float] = []
    logprobs: list[float] = []
    for seq in sequences:
        inputs = seq.inputs
        c, m = len(inputs.completion_ids), seq.num_tokens
        mask = seq.loss_mask or (True,) * c
        if len(mask) != c or sum(mask) != m or len(seq.versions) != m or len(seq.contexts) != m:
            raise ValueError("a sequence's logprobs, versions and contexts must match its model tokens")
        transform = inputs.transform
        header += [len(inputs.prompt_ids), c, int(bool(seq.loss_mask)), int(seq.trainable), seq.group_index]
        header += [transform.top_k]
        tokens += [
            *inputs.prompt_ids,
            *inputs.completion_ids,
            *(int(b) for b in mask),
            *seq.versions,
            *seq.contexts,
        ]
        scalars += [seq.advantage, transform.temperature, transform.top_p]
        logprobs += seq.rollout_logprobs
    ints = torch.tensor(header + tokens, dtype=torch.int64)
    floats = torch.tensor(scalars + logprobs, dtype=torch.float64)
    return ints, floats


def decode_sequences(ints: torch.Tensor, floats: torch.Tensor) -> list[ScoredSequence]:
    """The inverse of `encode_sequences` (host tensors)."""
    values, reals = ints.tolist(), floats.tolist()
    count = values[0]
    header = values[1 : 1 + HEADER * count]
    at, real_at, lp_at = 1 + HEADER * count, 0, 3 * count
    out: list[ScoredSequence] = []
    for i in range(count):
        prompt_len, c, has_mask, trainable, group_index, top_k = header[HEADER * i : HEADER * (i + 1)]
        prompt = tuple(values[at : at + prompt_len])
        at += prompt_len
        completion = tuple(values[at : at + c])
        mask = tuple(bool(b) for b in values[at + c : at + 2 * c])
        at += 2 * c
        m = sum(mask)
        versions = values[at : at + m]
        contexts = values[at + m : at + 2 * m]
        at += 2 * m
        advantage, temperature, top_p = reals[real_at : real_at + 3]
        real_at += 3
        transform = SamplingTransform(temperature, top_k, top_p)
        out.append(
            ScoredSequence(
                inputs=SequenceInput(prompt, completion, transform),
                rollout_logprobs=reals[lp_at : lp_at + m],
                versions=versions,
                advantage=advantage,
                trainable=bool(trainable),
                contexts=contexts,
                group_index=group_index,
                loss_mask=mask if has_mask else (),
            )
        )
        lp_at += m
    return out


def balance(sequences: list, world_size: int, length) -> list[list]:
    """`sequences` dealt to `world_size` ranks, longest first to the least-loaded rank (by
    `length(item)` tokens); each rank's list keeps the batch order."""
    loads = [0] * world_size
    owner: dict[int, int] = {}
    for index in sorted(range(len(sequences)), key=lambda i: -length(sequences[i])):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[index] = rank
        loads[rank] += length(sequences[index])
    return [[s for i, s in enumerate(sequences) if owner[i] == rank] for rank in range(world_size)]


def scatter_sequences(
    shards: list[list[ScoredSequence]] | None, device: torch.device
) -> list[ScoredSequence]:
    """Collective. Rank 0 passes every rank's shard; the others pass None. Returns this rank's."""
    import torch
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    sizes = torch.zeros(world_size, 2, dtype=torch.int64)
    encoded: list[tuple[torch.Tensor, torch.Tensor]] = []
    if rank == 0:
        assert shards is not None and len(shards) == world_size
        encoded = [encode_sequences(shard) for shard in shards]
        sizes = torch.tensor([[i.numel(), f.numel()] for i, f in encoded], dtype=torch.int64)
    sizes = sizes.to(device)
    dist.broadcast(sizes, src=0)
    sizes = sizes.cpu()
    longest_i, longest_f = int(sizes[:, 0].max()), max(1, int(sizes[:, 1].max()))  # never 0-sized
    ints = torch.zeros(longest_i, dtype=torch.int64, device=device)
    floats = torch.zeros(longest_f, dtype=torch.float64, device=device)
    if rank == 0:
        pad = lambda t, n: torch.cat([t, t.new_zeros(n - t.numel())]).to(device)  # noqa: E731
        dist.scatter(ints, [pad(i, longest_i) for i, _ in encoded], src=0)
        dist.scatter(floats, [pad(f, longest_f) for _, f in encoded], src=0)
    else:
        dist.scatter(ints, None, src=0)
        dist.scatter(floats, None, src=0)
    mine = sizes[rank]
    return decode_sequences(ints[: int(mine[0])].cpu(), floats[: int(mine[1])].cpu())


def encode_stats(stats: StepStats) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 payload, int64 lengths [one per tensor field]) of one rank's StepStats (host)."""
    import torch

    pieces = []
    for name in tensor_fields():
        tensor = getattr(stats, name)
        pieces.append(torch.zeros(0) if tensor is None else tensor.detach().reshape(-1).double().cpu())
    loss = math.nan if stats.loss is None else float(stats.loss)
    scalars = [
        loss,
        float(stats.nonfinite_tokens),
        float(stats.train_forward_tokens),
        float(stats.eval_forward_tokens),
    ]
    lengths = torch.tensor([p.numel() for p in pieces], dtype=torch.int64)
    payload = torch.cat([*[p.double() for p in pieces], torch.tensor(scalars, dtype=torch.float64)])
    return payload, lengths


def decode_stats(payloads: list[torch.Tensor], lengths: list[torch.Tensor]) -> StepStats:
    """One StepStats from every rank's payload (host tensors); an empty optional field is None."""
    import torch

    parts = []
    for payload, sizes in zip(payloads, lengths, strict=True):
        pieces = list(torch.split(payload[: int(sizes.sum()) + _SCALARS], [*sizes.tolist(), _SCALARS]))
        fields = {}
        for name, piece in zip(tensor_fields(), pieces, strict=False):
            if name in OPTIONAL_FIELDS and not piece.numel():
                fields[name] = None
            else:
                fields[name] = piece.to(getattr(torch, _DTYPES.get(name, "float32")))
        loss, nonfinite, train_tokens, eval_tokens = pieces[-1].tolist()
        parts.append(
            StepStats(
                **fields,
                loss=loss,
                nonfinite_tokens=int(nonfinite),
                train_forward_tokens=int(train_tokens),
                eval_forward_tokens=int(eval_tokens),
            )
        )
    return StepStats.join(parts)


def gather_stats(stats: StepStats, device: torch.device) -> StepStats | None:
    """Collective. Rank 0 gets the whole batch's StepStats; the other ranks get None."""
    import torch
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    payload, lengths = encode_stats(stats)
    every_length = [torch.zeros_like(lengths, device=device) for _ in range(world_size)]
    dist.all_gather(every_length, lengths.to(device))
    every_length = [t.cpu() for t in every_length]
    longest = max(int(t.sum()) for t in every_length) + _SCALARS
    padded = torch.cat([payload, payload.new_zeros(longest - payload.numel())]).to(device)
    if rank == 0:
        received = [torch.zeros(longest, dtype=torch.float64, device=device) for _ in range(world_size)]
        dist.gather(padded, received, dst=0)
        return decode_stats([t.cpu() for t in received], every_length)
    dist.gather(padded, None, dst=0)
    return None
