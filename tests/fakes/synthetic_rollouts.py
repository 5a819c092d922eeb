"""Rollout groups produced with the trainer's own numerics, for tests and the step benchmark.

`make_group` builds a `RolloutGroup` exactly as a rollout engine with the trainer's numerics would:
completions are sampled (or, with `sample=False`, drawn uniformly and then scored) and their logprobs
are the processed logprobs under the group's transform. With the same weights, the trainer's
lag-0 mismatch on such a group is 0 up to float32 reduction order. This is the reference path, not
a stand-in for vLLM: the vLLM comparison lives in tests/test_trainer_replay.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from parity.sampling import SamplingTransform, processed_logprobs
from parity.v1 import common_pb2, rollouts_pb2
from trainer.policy import SequenceInput, token_logprobs

PLAIN = SamplingTransform(1.0, 0, 1.0)

if TYPE_CHECKING:
    import torch


def make_group(
    model,
    group_id: str,
    rewards: Sequence[float],
    version: int = 0,
    prompt_len: int = 6,
    completion_len: int = 8,
    transform: SamplingTransform = PLAIN,
    generator: torch.Generator | None = None,
    sample: bool = True,
    vocab_low: int = 3,
) -> rollouts_pb2.RolloutGroup:
    """One group of len(rewards) samples, every token tagged with `version`."""
    import torch

    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = [int(t) for t in torch.randint(vocab_low, vocab, (prompt_len,), generator=generator)]
    group = rollouts_pb2.RolloutGroup(
        group_id=group_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(
            temperature=transform.temperature,
            top_k=transform.top_k,
            top_p=transform.top_p,
            max_tokens=completion_len,
            n=len(rewards),
        ),
        min_weight_version=version,
        max_weight_version=version,
        logprobs_mode=common_pb2.LOGPROBS_MODE_PROCESSED,
    )
    with torch.no_grad():
        for index, reward in enumerate(rewards):
            if sample:
                tokens = _sample(model, prompt, completion_len, transform, generator)
            else:
                tokens = [
                    int(t) for t in torch.randint(vocab_low, vocab, (completion_len,), generator=generator)
                ]
            logprobs, _ = token_logprobs(model, [SequenceInput(tuple(prompt), tuple(tokens), transform)])
            group.samples.add(
                rollout_id=f"{group_id}/{index}",
                token_ids=tokens,
                logprobs=logprobs.tolist(),  # one copy; float(x) per element syncs a CUDA tensor per token
                token_weight_versions=[version] * len(tokens),
                reward=float(reward),
            )
    return group


def _sample(model, prompt: list[int], length: int, transform: SamplingTransform, generator) -> list[int]:
    import torch

    ids = list(prompt)
    out: list[int] = []
    for _ in range(length):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1:].float()
        probs = processed_logprobs(logits, transform).exp()[0]
        token = (
            int(torch.argmax(probs))
            if transform.greedy
            else int(torch.multinomial(probs, 1, generator=generator))
        )
        out.append(token)
        ids.append(token)
    return out


def make_episode_group(
    model,
    group_id: str,
    rewards: Sequence[float],
    turns: Sequence[tuple[str, int]] = (("model", 5), ("environment", 4), ("model", 6)),
    version: int = 0,
    prompt_len: int = 6,
    transform: SamplingTransform = PLAIN,
    generator: torch.Generator | None = None,
    vocab_low: int = 3,
) -> rollouts_pb2.RolloutGroup:
    """A group of multi-turn episodes: `turns` of (role, length); model tokens drawn at random,
    environment tokens too (an observation). Model tokens get the processed logprobs of the whole
    sequence so far (environment tokens are their context), as an engine fed the exact token prefix
    would report; environment tokens carry none (rollouts.proto, RolloutSample.loss_mask)."""
    import torch

    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = [int(t) for t in torch.randint(vocab_low, vocab, (prompt_len,), generator=generator)]
    group = rollouts_pb2.RolloutGroup(
        group_id=group_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(
            temperature=transform.temperature,
            top_k=transform.top_k,
            top_p=transform.top_p,
            max_tokens=max(n for _, n in turns),
            n=len(rewards),
        ),
        min_weight_version=version,
        max_weight_version=version,
        logprobs_mode=common_pb2.LOGPROBS_MODE_PROCESSED,
    )
    with torch.no_grad():
        for index, reward in enumerate(rewards):
            tokens: list[int] = []
            mask: list[bool] = []
            spans = []
            for role, length in turns:
                start = len(tokens)
                tokens += [int(t) for t in torch.randint(vocab_low, vocab, (length,), generator=generator)]
                mask += [role == "model"] * length
                spans.append((role, start, len(tokens)))
            logprobs, _ = token_logprobs(
                model, [SequenceInput(tuple(prompt), tuple(tokens), transform)], keep=mask
            )
            sample = group.samples.add(
                rollout_id=f"{group_id}/{index}",
                token_ids=tokens,
                logprobs=logprobs.tolist(),  # one copy; float(x) per element syncs a CUDA tensor per token
                token_weight_versions=[version] * sum(mask),
                reward=float(reward),
                loss_mask=mask,
                episode_end=rollouts_pb2.EPISODE_END_DONE,
            )
            for role, start, end in spans:
                sample.turns.add(
                    role=rollouts_pb2.TURN_ROLE_MODEL
                    if role == "model"
                    else rollouts_pb2.TURN_ROLE_ENVIRONMENT,
                    start=start,
                    end=end,
                )
    return group
