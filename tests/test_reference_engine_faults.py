"""Every generation-time class of the fault catalogue, injected into the live reference engine.

The live `rollout.reference_engine.ReferenceEngine` (incremental generation with a KV cache) runs
in-process on the tiny model with `rollout.fault <class>@2`, after two real weight updates (v1, v2:
the engine's own pause and `_swap`; only the transport is faked, below). What it reports at v2 is
compared with the trainer's replay (float32 logits of a clean HF model over the same tokens,
`parity.sampling.processed_logprobs` with the request's transform): a clean engine matches it to
CLEAN_TOL; a faulty one matches, to a tolerance, what the catalogue says the class does to the data
(rebuilt here on the trainer side), and differs from the clean replay. The two multi-turn classes
act in the episode loop (rollout/episodes.py), not in the engine, and are not covered here.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest

from parity.config.rollout import RolloutConfig
from parity.faults import FAULTS, MULTI_TURN_FAULTS, PRESENCE_PENALTY, REPETITION_PENALTY, engine_transform
from parity.sampling import SamplingTransform, presence_penalised, processed_logprobs, repetition_penalised
from parity.v1 import common_pb2
from parity.weights.receiver import StagedWeights
from rollout.engine import GenerationSpec
from rollout.environments.base import StepResult
from rollout.reference_engine import ReferenceEngine
from tests.fakes.rollout_helpers import perturbed_state_dict

PROMPT = [5, 6, 7, 8] * 5  # repeated tokens: a repetition penalty shows on the first completion token
LENGTH, N = 12, 3
REQUESTED = SamplingTransform(0.8, 50, 0.95)
# Per token, max |engine - replay| of a clean engine: its KV-cache steps sum in another order than the
# replay's full-sequence forward (measured 0.9e-5 to 1.8e-5 on the tiny model; k3 ~1e-10, far under
# the running gate's 1e-6). A faulty engine must match its rebuilt data to the same tolerance (a bf16
# head's, looser: it rounds hidden states that differ in their last bits) and differ from the clean
# replay by more than SHOWN.
CLEAN_TOL, SHOWN = 1e-4, 1e-3
ENGINE_CLASSES = [name for name in FAULTS if name not in MULTI_TURN_FAULTS]
TOLERANCE = {"bf16_lm_head": 5e-2}


class FakeTransportReferenceEngine(ReferenceEngine):
    """The live reference engine with only its weight transport faked: `_stage` stages the tensors
    of an in-memory state dict instead of receiving a TransferPlan through a transfer group. The
    update protocol (pause, `_swap`, version, resume) is the engine's own."""

    _pending: dict

    async def _stage(self, plan, fault_corrupt_tensor: str) -> dict:
        self._staged = StagedWeights(
            names=list(self._pending), tensors=[t.clone() for t in self._pending.values()]
        )
        return self._staged.report()

    async def push(self, state: dict, version: int) -> None:
        self._pending = state
        result = await self.update_weights(common_pb2.TransferPlan(version=version), "keep")
        assert result.outcome == "applied", result.error


@pytest.fixture(scope="module")
def weights(tiny_model: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return {
        0: {k: v.clone() for k, v in base.state_dict().items()},
        1: perturbed_state_dict(tiny_model, seed=11),
        2: perturbed_state_dict(tiny_model, seed=12),
        "base": base,
    }


def _model(weights: dict, state: dict):
    model = copy.deepcopy(weights["base"])
    model.load_state_dict(state, strict=False)
    return model


def _generate(tiny_model: Path, weights: dict, fault: str, worker_index: int = 0) -> tuple:
    """(engine, its completions of one request at v2) after updates to v1 and v2."""
    config = RolloutConfig(engine="reference", max_model_len=512, enable_fault_injection=bool(fault),
                           fault=fault, worker_index=worker_index)  # fmt: skip
    engine = FakeTransportReferenceEngine(config, tiny_model)
    spec = GenerationSpec("r", PROMPT, n=N, max_tokens=LENGTH, temperature=REQUESTED.temperature,
                          top_k=REQUESTED.top_k, top_p=REQUESTED.top_p, seed=3, ignore_eos=True)  # fmt: skip

    async def scenario() -> list:
        await engine.start()
        try:
            await engine.push(weights[1], 1)
            await engine.push(weights[2], 2)
            return sorted([r async for r in engine.generate(spec)], key=lambda r: r.index)
        finally:
            await engine.shutdown()

    return engine, asyncio.run(scenario())


def _logits(model, prompt: list[int], tokens: list[int]):
    """[len(tokens), V] float32 logits that predict each of `tokens` after `prompt`."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def _chosen(logprobs_TV, tokens: list[int]) -> list[float]:
    import torch

    return logprobs_TV.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


def _replay(model, tokens: list[int], prompt: list[int] = PROMPT, transform: SamplingTransform = REQUESTED):
    return _chosen(processed_logprobs(_logits(model, prompt, tokens), transform), tokens)


def _expected(name: str, weights: dict, tokens: list[int]) -> tuple[list[float], list[int]]:
    """What the catalogue says an engine with `name` reports at v2 for `tokens`, rebuilt on the
    trainer side: (logprobs, version tags)."""
    import torch

    w1, w2 = weights[1], weights[2]
    m2 = _model(weights, w2)
    clean = _replay(m2, tokens)
    tags = [2] * len(tokens)
    if name == "raw_logprobs":
        return _chosen(_logits(m2, PROMPT, tokens).log_softmax(-1), tokens), tags
    if name == "logprobs_shifted":
        return [*clean[1:], clean[-1]], tags
    if name == "last_logprob_dropped":
        return [*clean[:-1], 0.0], tags
    if name == "last_logprob_perturbed":
        return [*clean[:-1], clean[-1] - 0.05], tags
    if name in ("temperature_replay", "top_k_replay", "top_p_replay", "generation_config_leak"):
        return _replay(m2, tokens, transform=engine_transform(name, REQUESTED)), tags
    if name in ("repetition_penalty_unreplayed", "presence_penalty_unreplayed"):
        logits = _logits(m2, PROMPT, tokens)
        rows = []
        for j in range(len(tokens)):
            if name == "repetition_penalty_unreplayed":
                rows.append(repetition_penalised(logits[j : j + 1], PROMPT + tokens[:j], REPETITION_PENALTY))
            else:
                rows.append(presence_penalised(logits[j : j + 1], tokens[:j], PRESENCE_PENALTY))
        return _chosen(processed_logprobs(torch.cat(rows), REQUESTED), tokens), tags
    if name == "prompt_token_drift":
        return _replay(m2, tokens, prompt=[PROMPT[0], *PROMPT]), tags
    if name == "truncated_context":
        return _replay(m2, tokens, prompt=PROMPT[len(PROMPT) // 2 :]), tags
    if name == "bf16_lm_head":
        with torch.no_grad():
            hidden = m2.model(input_ids=torch.tensor([PROMPT + tokens])).last_hidden_state[0]
            logits = (hidden.bfloat16() @ m2.lm_head.weight.bfloat16().T).float()[len(PROMPT) - 1 : -1]
        return _chosen(processed_logprobs(logits, REQUESTED), tokens), tags
    if name == "rope_theta":
        inv_freq = m2.model.rotary_emb.inv_freq
        n = inv_freq.numel()
        inv_freq.copy_(1.0 / 20000.0 ** (torch.arange(0, 2 * n, 2, dtype=torch.float32) / (2 * n)))
        return _replay(m2, tokens), tags
    if name == "untied_head":  # the embeddings at v2, the head as first loaded (v0)
        m2.lm_head.weight = torch.nn.Parameter(weights[0]["model.embed_tokens.weight"].clone())
        return _replay(m2, tokens), tags
    if name in ("stale_weights", "one_worker_not_updated"):
        return _replay(_model(weights, w1), tokens), tags
    if name == "tensor_not_updated":
        key = "model.layers.0.mlp.down_proj.weight"
        return _replay(_model(weights, {**w2, key: w1[key]}), tokens), tags
    if name == "swapped_tensors":
        q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
        return _replay(_model(weights, {**w2, q: w2[o], o: w2[q]}), tokens), tags
    if name == "bf16_weights":
        return _replay(_model(weights, {k: v.bfloat16().float() for k, v in w2.items()}), tokens), tags
    if name == "wrong_version_tag":
        half = len(tokens) // 2
        return clean, [2] * half + [1] * (len(tokens) - half)
    if name == "stale_prefix_kv":  # the prompt's KV (all but its last token) at v1, the rest at v2
        with torch.no_grad():
            cache = _model(weights, w1)(input_ids=torch.tensor([PROMPT[:-1]]), use_cache=True).past_key_values
            logits = m2(input_ids=torch.tensor([PROMPT[-1:] + tokens]), past_key_values=cache).logits[0]
        return _chosen(processed_logprobs(logits[:-1].float(), REQUESTED), tokens), tags
    if name == "async_first_token":
        return [_replay(_model(weights, w1), tokens)[0], *clean[1:]], tags
    raise AssertionError(f"no expectation for {name}")


def _delta(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_a_clean_live_engine_reports_the_trainers_replay_and_holds_no_fault_state(
    tiny_model: Path, weights: dict
) -> None:
    engine, results = _generate(tiny_model, weights, "")
    clean_model = _model(weights, weights[2])
    assert len(results) == N
    for result in results:
        assert result.token_weight_versions == [2] * LENGTH
        assert _delta(result.logprobs, _replay(clean_model, result.token_ids)) < CLEAN_TOL
    assert engine._stale_model is None and engine._first_head is None and engine._previous_update is None


@pytest.mark.parametrize("name", ENGINE_CLASSES)
def test_a_fault_in_the_live_engine_changes_what_it_reports_as_the_catalogue_says(
    name: str, tiny_model: Path, weights: dict
) -> None:
    worker_index = 1 if name == "one_worker_not_updated" else 0  # the second worker keeps v1
    _, results = _generate(tiny_model, weights, f"{name}@2", worker_index)
    clean_model = _model(weights, weights[2])
    off_clean = 0.0
    retagged = False
    for result in results:
        expected, tags = _expected(name, weights, result.token_ids)
        assert _delta(result.logprobs, expected) < TOLERANCE.get(name, CLEAN_TOL), (result.logprobs, expected)
        assert result.token_weight_versions == tags
        off_clean = max(off_clean, _delta(result.logprobs, _replay(clean_model, result.token_ids)))
        retagged |= tags != [2] * LENGTH
    assert retagged or off_clean > SHOWN, f"{name}: reported logprobs within {off_clean:.2e} of the replay"


def test_one_worker_not_updated_leaves_the_first_worker_clean(tiny_model: Path, weights: dict) -> None:
    _, results = _generate(tiny_model, weights, "one_worker_not_updated@2", worker_index=0)
    clean_model = _model(weights, weights[2])
    for result in results:
        assert _delta(result.logprobs, _replay(clean_model, result.token_ids)) < CLEAN_TOL


class _TwoTurns:
    """An environment of two model turns: the first answered with an observation, the second ends it."""

    def __init__(self) -> None:
        self.steps = 0

    async def reset(self, record) -> str:
        return "start"

    async def step(self, action: str) -> StepResult:
        self.steps += 1
        return StepResult("more", 0.0, self.steps >= 2)

    async def close(self) -> None:
        pass


def _episode(tiny_model: Path, fault: str) -> tuple:
    """One two-turn episode whose turns the engine sampled at v1 then v2 (an update between them);
    the first turn holds token 97, whose decode-then-encode round trip is 3 other tokens. Returns
    (episode, the prompts the engine was asked to continue)."""
    from transformers import AutoTokenizer

    from parity.faults import parse_fault
    from rollout.engine import CompletionResult
    from rollout.episodes import TurnTemplate, run_episode

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    turns = [([40, 97, 41, 2], 1), ([42, 43, 2], 2)]
    asked: list[list[int]] = []

    async def generate(ids: list[int], max_tokens: int, turn: int) -> CompletionResult:
        asked.append(list(ids))
        tokens, version = turns[turn]
        return CompletionResult(0, tokens, [-0.5] * len(tokens), [version] * len(tokens), "x", "stop")

    spec = parse_fault(fault) if fault else None
    episode = asyncio.run(
        run_episode(
            _TwoTurns(),
            {},
            lambda text: [10, 11, 12],
            generate,
            TurnTemplate(tokenizer, False),
            max_turns=3,
            max_episode_tokens=256,
            max_tokens=8,
            fault=spec,
        )
    )
    return episode, asked


def test_the_multi_turn_faults_act_in_the_episode_loop(tiny_model: Path) -> None:
    clean, clean_asked = _episode(tiny_model, "")
    assert clean.weight_versions == [1] * 4 + [2] * 3
    assert clean_asked[1] == [10, 11, 12, *clean.token_ids[: clean.turns[1].end]]  # the exact prefix

    tagged, _ = _episode(tiny_model, "episode_version_tag@2")
    assert tagged.weight_versions == tagged.context_versions == [1] * 7  # the later turn tagged v1
    assert (clean.faulty_turns, tagged.faulty_turns) == (0, 1)  # what the live bench joins on
    inactive = _episode(tiny_model, "episode_version_tag@3")[0]
    assert inactive.weight_versions == clean.weight_versions and inactive.faulty_turns == 0

    retokenized, asked = _episode(tiny_model, "episode_retokenized@1")
    assert retokenized.token_ids == clean.token_ids and retokenized.check_exact() == 0  # recorded exactly
    assert asked[1] != clean_asked[1] and 97 not in asked[1]  # the engine continued the round trip
    assert _episode(tiny_model, "episode_retokenized@2")[1] == clean_asked
