"""A step's metrics, pure: from what the stages returned to one flat dict (a metrics.jsonl line).

Names say what they measure (docs/trainer.md lists them):
- `mismatch_*`: trainer vs rollout logprobs over clean lag-0 tokens (sampled at the current version
  over KV of that version): the backend mismatch.
- `mismatch_*_own_version`: the same over clean lag-0 tokens plus stale tokens rescored under their
  own version (absent when own-version scoring is off); `*_mixed_context`: lag-0 tokens whose KV
  came from older weights, kept apart.
- `mismatch_{k3,max_abs}_own_version_informative`: the own-version tokens whose processed
  distribution is not degenerate (entropy > INFORMATIVE_ENTROPY_NATS); a token that top-k/top-p
  left alone, or whose probability rounds to 1 in float32, has logprob 0 on both sides whatever the
  backend does and cannot show a fault. `own_version_informative_tokens` counts them; the running
  gate judges these (NaN, "not measured", when there are none).
- `policy_drift_*`: every token against the current weights, stale ones included.
- `version_tag_violations`: tokens whose version tags no engine can produce
  (parity/versions.py `impossible_tags`);
  any makes the running gate act at once, whatever the numbers (trainer/mismatch_gate.py).
A metric with nothing to measure is NaN (null in metrics.jsonl), never 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parity import mismatch
from parity.versions import impossible_tags
from trainer import offpolicy
from trainer.consumer import Batch, token_versions
from trainer.device import peak_flops, peak_memory_bytes
from trainer.own_version import OwnVersionSample
from trainer.prepare import PreparedBatch
from trainer.stats import StepStats
from trainer.step import OptimizerResult

if TYPE_CHECKING:
    from trainer.checkpoint import TrainerState

SAMPLES_PER_STEP = 4  # completions per step written to samples.jsonl (run trackers show them)
# A processed distribution with entropy at or below this is degenerate: one candidate, or a top
# probability that rounds to 1 in float32 (the next-largest float32 below 1 is 1 - 6e-8, whose
# entropy is ~1e-6 nats at the smallest). Such a token's logprob is 0 on every backend.
INFORMATIVE_ENTROPY_NATS = 1e-6
STAT_KEYS = ("k1", "k2", "k3", "max_abs", "ratio_p05", "ratio_p50", "ratio_p95", "nonfinite_tokens")


@dataclass(frozen=True)
class SpeedInputs:
    """What MFU needs besides the step's statistics."""

    device: Any
    precision: str
    flops_per_token: float
    world_size: int
    has_ref_model: bool


def step_metrics(
    batch: Batch,
    prepared: PreparedBatch,
    stats: StepStats,
    optimizer: OptimizerResult,
    state: TrainerState,
    step_time_s: float,
) -> dict[str, Any]:
    """Rewards, mismatch and drift, off-policy accounting, loss and optimizer figures."""
    import torch

    trainer_T, rollout_T, lags_T = stats.trainer_logprobs, stats.rollout_logprobs, stats.lags
    # Backend mismatch needs a clean token: sampled at the current version over KV of that
    # version. Policy drift is every token against the current weights, stale ones included.
    lag0_T = lags_T == 0
    clean_lag0_T = lag0_T & stats.clean
    on_lag0 = mismatch.mismatch_stats(trainer_T[clean_lag0_T], rollout_T[clean_lag0_T])
    on_all = mismatch.mismatch_stats(trainer_T, rollout_T)
    nan = math.nan
    rewards = prepared.rewards
    rewards_t = torch.tensor(rewards, dtype=torch.float64)
    num_tokens = stats.num_tokens
    metrics: dict[str, Any] = {
        "step": state.step + 1,
        "weight_version": state.weight_version,
        "reward_mean": float(rewards_t.mean()) if rewards else nan,
        "reward_std": float(rewards_t.std(unbiased=False)) if rewards else nan,
        "clip_rate": _mean(stats.clip.float()),
        "kl_new_old": _mean(stats.kl_new_old),
        "entropy": _mean(stats.entropy),
    }
    # Statistics over the tokens with finite logprobs (NaN when there are none); the others are
    # counted in mismatch_nonfinite_tokens*.
    for prefix, measured in (("mismatch_", on_lag0), ("policy_drift_", on_all)):
        for key in STAT_KEYS:
            metrics[f"{prefix}{key}"] = getattr(measured, key)
    if stats.at_version_trainer_logprobs is not None:  # only with --old_logprobs recompute
        at_version_T = stats.at_version_trainer_logprobs
        on_version = mismatch.mismatch_stats(at_version_T, stats.at_version_rollout_logprobs)
        for key in ("k1", "k2", "k3", "max_abs", "nonfinite_tokens"):
            metrics[f"mismatch_{key}_at_version"] = getattr(on_version, key)
        metrics["at_version_token_frac"] = at_version_T.numel() / num_tokens if num_tokens else nan
    any_tokens = bool(lags_T.numel())
    metrics.update(
        {
            "ess": on_all.ess,
            "ess_lag0": on_lag0.ess,
            "lag_mean": float(lags_T.float().mean()) if any_tokens else nan,
            "lag_max": int(lags_T.max()) if any_tokens else nan,
            "lag_hist": offpolicy.lag_histogram(lags_T.tolist()),
            "lag0_token_frac": float(lag0_T.float().mean()) if any_tokens else nan,
            # The tokens mismatch_* is measured over (clean lag-0); 0 means mismatch_* is NaN.
            "mismatch_tokens": int(clean_lag0_T.sum()),
            "dropped_stale": batch.dropped_stale,
            "dropped_stale_total": state.dropped_stale_total + batch.dropped_stale,
            "dropped_future_version": batch.dropped_future_version,
            "dropped_future_version_total": state.dropped_future_version_total + batch.dropped_future_version,
            "duplicates_skipped": batch.duplicates,
            "malformed": batch.malformed,
            "zero_variance_groups": prepared.zero_variance_groups,
            "num_groups": len(batch.groups),
            "num_sequences": len(prepared.sequences),
            "num_tokens": num_tokens,
            "trainable_tokens": sum(s.num_tokens for s in prepared.trainable),
            "trainer_nonfinite_tokens": int(stats.nonfinite_tokens),
            "loss": stats.loss,
            "grad_norm": optimizer.grad_norm,
            "lr": optimizer.lr,
            "is_weight_mean": _mean(stats.is_weights),
            "is_corrected_frac": _mean(stats.is_corrected),
            "kl_ref": _mean(stats.kl_ref),
            "queue_wait_s": batch.wait_s,
            "step_time_s": step_time_s,
            "tokens_per_s": num_tokens / step_time_s if step_time_s > 0 else nan,
        }
    )
    return metrics


def version_tag_metrics(batch: Batch) -> dict[str, Any]:
    """`version_tag_violations`: the step's tokens with impossible tags (0 in a correct run)."""
    return {
        "version_tag_violations": sum(
            impossible_tags(s.token_weight_versions, s.token_context_versions)
            for g in batch.groups
            for s in g.samples
        )
    }


def episode_metrics(batch: Batch) -> dict[str, Any]:
    """Multi-turn episodes of the step (absent when it had none): how many, their turns and
    environment tokens, how they ended, and the token-in/token-out checks the rollout service made
    (`episode_token_mismatches` must be 0; `episode_retokenization_drift_tokens` is what a
    decode-then-encode loop would have changed)."""
    from parity.v1 import rollouts_pb2

    episodes = [s for g in batch.groups for s in g.samples if s.loss_mask]
    if not episodes:
        return {}
    model_turns = [sum(t.role == rollouts_pb2.TURN_ROLE_MODEL for t in s.turns) for s in episodes]
    metrics: dict[str, Any] = {
        "episodes": len(episodes),
        "episode_model_turns_mean": sum(model_turns) / len(episodes),
        "episode_model_tokens": sum(sum(s.loss_mask) for s in episodes),
        "episode_environment_tokens": sum(len(s.loss_mask) - sum(s.loss_mask) for s in episodes),
        "episode_token_mismatches": sum(s.token_mismatches for s in episodes),
        "episode_retokenization_drift_tokens": sum(s.retokenization_drift for s in episodes),
    }
    for name, value in rollouts_pb2.EpisodeEnd.items():
        if value:
            key = name.removeprefix("EPISODE_END_").lower()
            metrics[f"episode_end_{key}"] = sum(s.episode_end == value for s in episodes)
    return metrics


def own_version_metrics(stats: StepStats, own_version: OwnVersionSample | None) -> dict[str, Any]:
    """mismatch_*_own_version over every clean lag-0 token plus the rescored sample, and the
    mixed-context lag-0 tokens as their own class. Absent when own-version scoring is off."""
    import torch

    trainer_T, rollout_T = stats.trainer_logprobs, stats.rollout_logprobs
    lag0_T, clean_T = stats.lags == 0, stats.clean
    metrics: dict[str, Any] = {}
    mixed = mismatch.mismatch_stats(trainer_T[lag0_T & ~clean_T], rollout_T[lag0_T & ~clean_T])
    for key in ("k1", "k3", "max_abs"):
        metrics[f"mismatch_{key}_mixed_context"] = getattr(mixed, key)
    metrics["mixed_context_tokens"] = int((lag0_T & ~clean_T).sum())
    if own_version is None:
        return metrics
    own_trainer_T = torch.cat([trainer_T[lag0_T & clean_T], own_version.trainer_logprobs])
    own_rollout_T = torch.cat([rollout_T[lag0_T & clean_T], own_version.rollout_logprobs])
    rescored_entropy_T = own_version.entropy
    if rescored_entropy_T is None:  # not measured: no rescored token counts as informative
        rescored_entropy_T = torch.full_like(own_version.trainer_logprobs, math.nan)
    own_entropy_T = torch.cat([stats.entropy[lag0_T & clean_T].float(), rescored_entropy_T.float()])
    own = mismatch.mismatch_stats(own_trainer_T, own_rollout_T)
    for key in STAT_KEYS:
        metrics[f"mismatch_{key}_own_version"] = getattr(own, key)
    informative_T = own_entropy_T > INFORMATIVE_ENTROPY_NATS  # NaN entropy: not informative
    informative = mismatch.mismatch_stats(own_trainer_T[informative_T], own_rollout_T[informative_T])
    for key in ("k3", "max_abs"):
        metrics[f"mismatch_{key}_own_version_informative"] = getattr(informative, key)
    metrics["own_version_informative_tokens"] = int(informative_T.sum())
    metrics["own_version_tokens"] = int(own_trainer_T.numel())
    metrics["own_version_rescored_tokens"] = int(own_version.trainer_logprobs.numel())
    metrics["own_version_score_s"] = own_version.seconds
    return metrics


def speed_metrics(stats: StepStats, speed: SpeedInputs, step_time_s: float) -> dict[str, Any]:
    """Peak memory of the step (CUDA allocator peak; on CPU the process's peak RSS) and MFU:
    model FLOPs (6N per trained token, 2N per forward-only token, 2N per reference-model token)
    over step time x the device's dense peak x ranks. MFU is absent when the peak is unknown."""
    out: dict[str, Any] = {"peak_memory_gib": peak_memory_bytes(speed.device) / 2**30}
    peak = peak_flops(speed.device, speed.precision)
    if peak is not None and step_time_s > 0:
        forward_only = stats.eval_forward_tokens
        if speed.has_ref_model:
            forward_only += stats.train_forward_tokens
        flops = speed.flops_per_token * (stats.train_forward_tokens + forward_only / 3)
        out["mfu"] = flops / (step_time_s * peak * speed.world_size)
    return out


def _mean(values) -> float:
    """The mean over the measured (finite) values; NaN when there are none."""
    import torch

    measured = values[torch.isfinite(values.float())].float()
    return float(measured.mean()) if measured.numel() else math.nan


def flops_per_token(model) -> float:
    """Training FLOPs per token, 6 x parameters outside the input embedding (forward 2N, backward
    4N; attention's sequence-length term left out). Counted before sharding."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    non_embedding = total - embed.numel() + (embed.numel() if head is embed else 0)
    return 6.0 * non_embedding


def step_samples(batch: Batch, version: int, step: int, limit: int = SAMPLES_PER_STEP) -> list[dict]:
    """A few of the step's completions for run trackers: the first sample of the first `limit`
    groups, with its prompt, reward, newest token version and lag (trainer version - oldest token)."""
    out = []
    for group in batch.groups[:limit]:
        sample = group.samples[0]
        versions = token_versions(group, sample) or [int(group.min_weight_version)]
        out.append(
            {
                "step": step,
                "rollout_id": sample.rollout_id,
                "prompt": group.prompt_text,
                "completion": sample.text,
                "reward": float(sample.reward),
                "version": max(versions),
                "lag": version - min(versions),
                **episode_sample(sample, versions),
            }
        )
    return out


def episode_sample(sample, versions: list[int]) -> dict:
    """An episode's turns for samples.jsonl: role, token count, reward, and for model turns the
    weight versions their tokens were sampled at (an episode may span updates)."""
    from parity.v1 import rollouts_pb2

    if not sample.loss_mask:
        return {}
    turns, model_at = [], 0
    for turn in sample.turns:
        entry: dict[str, Any] = {"tokens": turn.end - turn.start}
        if turn.role == rollouts_pb2.TURN_ROLE_MODEL:
            n = turn.end - turn.start
            entry.update(role="model", versions=sorted(set(versions[model_at : model_at + n])))
            model_at += n
        else:
            entry["role"] = "environment"
        if turn.HasField("reward"):
            entry["reward"] = turn.reward
        turns.append(entry)
    end = rollouts_pb2.EpisodeEnd.Name(sample.episode_end).removeprefix("EPISODE_END_").lower()
    return {"episode_end": end, "turns": turns}
