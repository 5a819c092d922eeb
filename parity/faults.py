"""The catalogue of train-inference parity faults (issue 36): every known way a rollout backend
breaks parity, by name, with where it lives and what it does to the data the trainer receives.

Two engines inject them, both with the per-class data transforms below (`engine_transform`,
`corrupt_update`, `penalised`, `conditioned_prompt`, `reported`, `double_rope_theta`):
`rollout.faults.ReferenceEngine` in-process (tests and `parity check --faults`), and the live
reference engine `rollout.reference_engine.ReferenceEngine` of a `parity run` (`rollout.fault`;
the two multi-turn classes in the episode loop, rollout/episodes.py). `trainer.mismatch_locate`
names the most likely ones when the running gate fires.

A fault is selected by PARITY_FAULT="<name>@<version>" (active for every rollout sampled at weight
version >= <version>); it is honoured only where fault injection is enabled
(`rollout.enable_fault_injection`), otherwise `fault_from_env` refuses it naming that setting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ENV_VAR = "PARITY_FAULT"
REPETITION_PENALTY = 1.3  # what repetition_penalty_unreplayed applies
PRESENCE_PENALTY = 0.5  # what presence_penalty_unreplayed applies
# Classes that only multi-turn episodes can show: the fault check runs them (and a clean control)
# with two model turns per sample, the first sampled one weight version before the second (an update
# arriving between turns, as it does in async runs of long episodes).
MULTI_TURN_FAULTS = ("episode_retokenized", "episode_version_tag")


@dataclass(frozen=True)
class Fault:
    name: str
    site: str  # where it lives in a real engine
    looks_like: str  # what it does to the data the trainer receives


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault("raw_logprobs", "logprob reporting",
              "logprobs of the raw logits (no temperature/top-k/top-p): every token off by the "
              "transform's log-normaliser, so k3 is large on every informative token"),
        Fault("logprobs_shifted", "logprob reporting",
              "token i carries token i+1's logprob (the last repeats): large |delta| at every position"),
        Fault("last_logprob_dropped", "logprob reporting",
              "the last token's logprob is missing and zero-filled: |delta| = -logprob at the last position only"),
        Fault("last_logprob_perturbed", "logprob reporting",
              "the last token's logprob is 0.05 nats low: a small error at one position per sample"),
        Fault("temperature_replay", "sampling transform",
              "the engine samples at 1.5x the requested temperature; the trainer replays the requested one"),
        Fault("top_k_replay", "sampling transform",
              "the engine applies top_k 4x larger than requested (more candidates, lower logprobs)"),
        Fault("top_p_replay", "sampling transform",
              "the engine ignores top_p (samples from the full distribution after top-k)"),
        Fault("stale_weights", "weight update",
              "the engine keeps serving version v-1 while labelling tokens v: one step of policy drift"),
        Fault("tensor_not_updated", "weight update",
              "one weight tensor (the first MLP down-projection) keeps its previous value after an update"),
        Fault("swapped_tensors", "weight update",
              "two same-shaped tensors (layer 0's q_proj and o_proj) are loaded into each other's place"),
        Fault("wrong_version_tag", "version accounting",
              "the second half of each sample is tagged v-1 though sampled at v: rescored at the wrong weights"),
        Fault("repetition_penalty_unreplayed", "sampling transform",
              "the engine applies repetition_penalty 1.3 to tokens already in the sequence; the trainer "
              "replays no penalty: repeated tokens' logprobs differ"),
        Fault("prompt_token_drift", "tokenization",
              "the engine conditions on the recorded prompt with its first token twice (a chat template "
              "that adds its opening token, such as BOS, to a prompt that already starts with it): every "
              "completion logprob is scored on another context"),
        Fault("episode_retokenized", "tokenization (multi-turn)",
              "the episode loop keeps the conversation as text and encodes it again before each model "
              "turn; the sample records the tokens the model sampled, so a later turn's logprobs were "
              "computed on another context wherever the decode-then-encode round trip changed tokens"),
        Fault("episode_version_tag", "version accounting (multi-turn)",
              "a weight update lands between two model turns and the episode loop tags every token "
              "with the version its first turn was sampled at: the later turn, sampled at v, is "
              "rescored at v-1 (one step of policy drift on the later turns only)"),
        Fault("rope_theta", "model config",
              "the engine's RoPE theta is 2x the trainer's: attention drifts with distance from each token"),
        Fault("bf16_lm_head", "model numerics",
              "the engine's lm_head runs in bf16 (hidden state and head weight rounded): ~1e-2 logit noise"),
        Fault("bf16_weights", "model numerics",
              "the engine holds every weight rounded to bf16 (computing in fp32): small noise on every token"),
        Fault("presence_penalty_unreplayed", "sampling transform",
              "the engine subtracts presence_penalty 0.5 from tokens already in the completion; the "
              "trainer replays none: tokens that repeat the completion read low"),
        Fault("generation_config_leak", "sampling transform",
              "the model's generation_config defaults (temperature 0.7, top_k 20, top_p 0.8) replace the "
              "request's settings: several settings differ at once"),
        Fault("untied_head", "weight update",
              "tied embeddings untied on the engine: its lm_head keeps the weights of its first load while "
              "the input embeddings are updated"),
        Fault("stale_prefix_kv", "cache",
              "the prompt's KV comes from a prefix cache filled at version v-1 (no reset, no salt) while "
              "the completion runs at v: every completion token attends to stale keys and values"),
        Fault("truncated_context", "model config",
              "the engine's max context is shorter: it conditions on the last half of the prompt only"),
        Fault("async_first_token", "scheduling",
              "the first token after an update is sampled and scored at v-1 but tagged v (a step in "
              "flight across the weight switch): mismatch at the first position only"),
        Fault("one_worker_not_updated", "weight update",
              "of two rollout workers, worker-1 keeps serving v-1 while labelling tokens v; worker-0 is "
              "correct: the mismatch lives on one worker's groups only"),
    )
}  # fmt: skip


@dataclass(frozen=True)
class FaultSpec:
    fault: Fault
    start_version: int

    def active(self, version: int) -> bool:
        return version >= self.start_version


def parse_fault(value: str, source: str = ENV_VAR) -> FaultSpec:
    """'<name>@<version>' -> FaultSpec; a clear error naming `source` on bad input."""
    name, _, at = value.partition("@")
    if name not in FAULTS:
        raise ValueError(f"{source}: unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}")
    try:
        start = int(at) if at else 0
    except ValueError:
        raise ValueError(f"{source}: version after '@' must be an integer, got {at!r}") from None
    if start < 0:
        raise ValueError(f"{source}: version must be >= 0, got {start}")
    return FaultSpec(FAULTS[name], start)


def fault_from_env(enabled: bool, environ: Mapping[str, str] | None = None) -> FaultSpec | None:
    """The fault PARITY_FAULT names, or None. Refused unless fault injection is enabled."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not value:
        return None
    if not enabled:
        raise ValueError(
            f"{ENV_VAR}={value!r} needs fault injection enabled (rollout.enable_fault_injection true)"
        )
    return parse_fault(value)


# Every class is injectable into a live `parity run` (`rollout.fault`, rollout.engine reference).
# one_worker_not_updated shows only with two or more rollout workers (it acts on the second), and the
# MULTI_TURN_FAULTS only in a multi-turn task (episode_version_tag only when an update lands between
# two turns of an episode: async mode).
LIVE_FAULTS = tuple(FAULTS)
PENALTY_FAULTS = ("repetition_penalty_unreplayed", "presence_penalty_unreplayed")
# Classes whose engine needs the weights it held before its last update (kept only while one is set).
STALE_MODEL_FAULTS = ("stale_prefix_kv", "async_first_token")


def engine_transform(fault: str, requested):
    """The sampling transform an engine with `fault` applies for a `requested` one (a
    parity.sampling.SamplingTransform); the requested one when the fault is not a replay fault."""
    from dataclasses import replace

    if fault == "temperature_replay":
        return replace(requested, temperature=requested.temperature * 1.5)
    if fault == "top_k_replay":
        return replace(requested, top_k=requested.top_k * 4)
    if fault == "top_p_replay":
        return replace(requested, top_p=1.0)
    if fault == "generation_config_leak":
        return type(requested)(0.7, 20, 0.8)  # Qwen2.5-Instruct-style generation_config defaults
    return requested


def corrupt_update(fault: str, new: dict, current: dict, previous: dict | None) -> dict:
    """What a weight update with `fault` loads instead of `new` (name -> tensor): `current` is what
    the engine holds, `previous` what the update before asked for."""
    if fault == "stale_weights":
        return dict(previous) if previous is not None else {}
    out = dict(new)
    if fault == "tensor_not_updated":
        name = next((k for k in out if "down_proj" in k), None)
        if name is not None:
            out[name] = current[name]
    elif fault == "swapped_tensors":
        q = next((k for k in out if "layers.0." in k and "q_proj.weight" in k), None)
        o = next((k for k in out if "layers.0." in k and "o_proj.weight" in k), None)
        if q and o and out[q].shape == out[o].shape:
            out[q], out[o] = out[o], out[q]
    elif fault == "bf16_weights":
        out = {k: v.bfloat16().to(v.dtype) if v.is_floating_point() else v for k, v in out.items()}
    return out


def penalised(fault: str, logits_1V, prompt: Sequence[int], completion: Sequence[int]):
    """The logits an engine with `fault` samples the token after `prompt + completion` from: a
    penalty fault's penalty applied (vLLM's), else `logits_1V` itself."""
    from parity.sampling import presence_penalised, repetition_penalised

    if fault == "repetition_penalty_unreplayed":
        return repetition_penalised(logits_1V, [*prompt, *completion], REPETITION_PENALTY)
    if fault == "presence_penalty_unreplayed" and completion:
        return presence_penalised(logits_1V, completion, PRESENCE_PENALTY)
    return logits_1V


def conditioned_prompt(fault: str, prompt: Sequence[int]) -> list[int]:
    """The prompt an engine with `fault` conditions on (the sample records the requested one):
    prompt_token_drift doubles its first token, truncated_context keeps its last half."""
    out = list(prompt)
    if fault == "prompt_token_drift" and out:
        out = out[:1] + out
    elif fault == "truncated_context":
        out = out[len(out) // 2 :]
    return out


def reported(fault: str, logprobs: Sequence[float], versions: Sequence[int]) -> tuple[list[float], list[int]]:
    """The logprobs and weight-version tags an engine with a reporting or version-accounting `fault`
    reports for one completion's tokens (copies; unchanged for other classes)."""
    logprobs, versions = list(logprobs), list(versions)
    if not logprobs:
        return logprobs, versions
    if fault == "logprobs_shifted":
        logprobs = [*logprobs[1:], logprobs[-1]]
    elif fault == "last_logprob_dropped":
        logprobs[-1] = 0.0
    elif fault == "last_logprob_perturbed":
        logprobs[-1] -= 0.05
    elif fault == "wrong_version_tag" and versions[-1] > 0:
        half = len(versions) // 2
        versions[half:] = [v - 1 if v > 0 else v for v in versions[half:]]
    return logprobs, versions


def double_rope_theta(model) -> None:
    """rope_theta: doubles the RoPE base of a Hugging Face Llama-style `model` in place (its rotary
    inv_freq recomputed at 2x the configured theta)."""
    import torch

    rope = model.model.rotary_emb
    base = float(getattr(model.config, "rope_theta", None) or 10000.0) * 2
    n = rope.inv_freq.numel()
    inv_freq = 1.0 / base ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n))
    with torch.no_grad():
        rope.inv_freq.copy_(inv_freq)
