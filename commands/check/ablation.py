"""`parity check --ablate`: turn each correctness fix off on its own and measure the mismatch.

Rows (each differs from the base configuration in exactly the named setting):
  base                       the configured settings (the correctness defaults unless told otherwise)
  raw_logprobs               logprobs_mode=raw: logprobs of the raw logits, not of what was sampled
  bf16_rollouts              dtype=bfloat16 with the fp32 head
  model_dtype_head           dtype=bfloat16 and head_dtype=model; compare with bf16_rollouts (with an
                             fp32 model the head is fp32 whatever the setting, so bf16 is needed)
  prefix_cache_no_reset      prefix caching on, no reset across a weight update made during the check
  prefix_cache_reset         the same engine after `reset_prefix_cache()`: the fix, as a control
  generation_config_auto     generation_config=auto, requests built the way Parity builds them
  generation_config_auto_openai  the same engine, requests built like vLLM's OpenAI server does
                             (the model's defaults fill every field the request leaves unset)

How the rows are produced, and why so:
  - Every row runs on `rollout.vllm_engine.VllmEngine`, the class the rollout service serves
    with: its engine arguments, top-k/top-p masking, sampling parameters, cache salt, weight swap
    and result conversion. It runs in the engine's in-process mode (`start_in_process`: vLLM's
    engine core and worker in this process, synchronous calls), which starts in ~8 s on tiny
    instead of ~22 s for the service's AsyncLLM with its engine-core and worker processes; that is
    what makes six engines per ablation affordable.
  - The weight update of the prefix rows loads a directory into the worker extension's staging and
    swaps it in with the service's own `parity_apply_staged` (vLLM `reload_weights`); only the
    transfer is skipped. The new weights are the base weights plus seeded Gaussian noise
    (`update_scale` x each tensor's std). Prompts are prefilled at the old weights first, then
    resampled at the new ones. vLLM caches only full KV blocks and the CPU default block is 128
    tokens, longer than our prompts, so these rows use 32 tokens (the smallest the CPU attention
    backend accepts; vLLM's GPU default is 16): with 128 the stale KV would be hidden on CPU, not
    absent on GPU.
  - tiny and SmolLM2 ship no sampling defaults in generation_config.json, so the generation_config
    rows use a copy of the model whose generation_config.json carries Qwen2.5-Instruct-style
    defaults (GENERATION_DEFAULTS). Parity's engine passes explicit SamplingParams, which vLLM does
    not merge with those defaults; a client of vLLM's OpenAI server that omits a field gets them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rollout.worker_extension import ParityWorkerExtension

# What Qwen2.5-*-Instruct ship in generation_config.json: a realistic set of hidden sampling defaults.
GENERATION_DEFAULTS = {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
PREFIX_BLOCK_SIZE = 32
CHECK_WORKER_EXTENSION = "commands.check.ablation.CheckWorkerExtension"
# Top logprobs asked for per token: their gaps tell whether the engine's logits were float32
# (parity.head_lattice); 8 give 7 gaps per position that the sampling transform keeps whole.
TOP_LOGPROBS = 8


@dataclass(frozen=True)
class Ablation:
    """One row: a name, what it shows, and the RolloutConfig fields it changes from the base."""

    name: str
    description: str
    changes: dict[str, object]
    compare_with: str = "base"


ABLATIONS = (
    Ablation(
        "raw_logprobs",
        "logprobs of the raw logits instead of the sampled distribution",
        {"logprobs_mode": "raw"},
    ),
    Ablation(
        "bf16_rollouts", "bf16 weights/activations in the engine (fp32 head kept)", {"dtype": "bfloat16"}
    ),
    Ablation(
        "model_dtype_head",
        "lm_head in the model dtype (bf16) instead of fp32",
        {"dtype": "bfloat16", "head_dtype": "model"},
        compare_with="bf16_rollouts",
    ),
    Ablation(
        "prefix_cache_no_reset",
        "prefix cache on, not reset across a weight update",
        {"prefix_caching": True, "reset_prefix_cache_on_update": False},
    ),
    Ablation(
        "generation_config_auto",
        "model generation_config defaults, Parity's request path",
        {"generation_config": "auto"},
    ),
)
CONTROL_ROWS = {
    "prefix_cache_reset": Ablation(
        "prefix_cache_reset",
        "control: same engine after reset_prefix_cache()",
        {"prefix_caching": True, "reset_prefix_cache_on_update": True},
        compare_with="prefix_cache_no_reset",
    ),
    "generation_config_auto_openai": Ablation(
        "generation_config_auto_openai",
        "model defaults fill unset request fields (OpenAI server)",
        {"generation_config": "auto"},
    ),
}


@dataclass(frozen=True)
class SamplingSetup:
    """The sampling transform and sizes of a check; identical for the rollout and trainer sides."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    samples_per_prompt: int
    seed: int


@dataclass(frozen=True)
class RawCompletion:
    """What the rollout side returned for one completion (before the trainer rescored it)."""

    prompt_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    # per token, the logprobs of the most likely tokens (TOP_LOGPROBS of them): the head-precision test
    top_logprobs: tuple[tuple[float, ...], ...] = ()


class CheckWorkerExtension(ParityWorkerExtension):
    """The rollout worker extension plus a local-directory weight load for the check's update."""

    def parity_check_load_dir(self, model_dir: str, version: int) -> dict:
        """Stage the tensors of `model_dir` as if they had arrived and been verified, then swap them
        in with the service's own `parity_apply_staged`: the shipped swap, without the transfer."""
        from safetensors.torch import load_file

        named = []
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            named.extend(load_file(str(path)).items())
        if not named:
            return {"error": f"no safetensors weights in {model_dir}"}
        self._parity_staged = (version, named)
        return self.parity_apply_staged(version)


def perturbed_copy(model_dir: Path, out_dir: Path, scale: float, seed: int) -> Path:
    """Copy `model_dir` to `out_dir` with every float tensor w -> w + scale * std(w) * N(0, 1)."""
    import torch
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for path in model_dir.iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(str(path))
            for name in sorted(tensors):
                t = tensors[name]
                if t.is_floating_point() and t.numel() > 1:
                    noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
                    tensors[name] = (t.float() + scale * t.float().std() * noise).to(t.dtype)
            save_file(tensors, str(out_dir / path.name), metadata={"format": "pt"})
        elif path.is_file() and path.name != "MANIFEST.json":
            shutil.copy2(path, out_dir / path.name)
    return out_dir


def with_generation_defaults(model_dir: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` (weights symlinked) whose generation_config.json has GENERATION_DEFAULTS."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.name not in ("MANIFEST.json", "generation_config.json"):
            (out_dir / path.name).symlink_to(path.resolve())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    (out_dir / "generation_config.json").write_text(json.dumps({**gen, **GENERATION_DEFAULTS}, indent=2))
    return out_dir


def start_engine(config, model_dir: Path, seed: int, block_size: int | None = None):
    """The rollout service's engine class, started in this process with the check's worker extension."""
    from rollout.vllm_engine import VllmEngine

    engine = VllmEngine(config, model_dir, seed=seed)
    overrides: dict[str, object] = {"worker_extension_cls": CHECK_WORKER_EXTENSION}
    if block_size is not None:
        overrides["block_size"] = block_size
    engine.start_in_process(**overrides)
    return engine


def generate(
    engine, prompts: Sequence[Sequence[int]], sampling: SamplingSetup, openai_style: bool = False
) -> list[RawCompletion]:
    """Sample `samples_per_prompt` completions per prompt, seeded per prompt, in one batch."""
    from rollout.engine import GenerationSpec

    specs = [
        GenerationSpec(
            request_id=f"check-{i}",
            prompt_token_ids=list(prompt),
            n=sampling.samples_per_prompt,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=sampling.seed * 100_003 + i,
            top_logprobs=TOP_LOGPROBS,
        )
        for i, prompt in enumerate(prompts)
    ]
    params = [openai_request(engine, spec) for spec in specs] if openai_style else None
    results = engine.generate_in_process(specs, params)
    return [
        RawCompletion(
            prompt_index=i,
            token_ids=tuple(c.token_ids),
            logprobs=tuple(c.logprobs),
            top_logprobs=tuple(tuple(lp for _, lp in top) for top in c.top_logprobs),
        )
        for i, completions in enumerate(results)
        for c in completions
    ]


def openai_request(engine, spec):
    """The SamplingParams vLLM's OpenAI server builds for `spec`: the request names only the fields
    that differ from the OpenAI API's neutral values, the model's generation config fills the rest."""
    from vllm import SamplingParams

    explicit: dict[str, object] = {
        "n": spec.n,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "seed": spec.seed,
        "logprobs": 0,
    }
    if spec.top_p < 1.0:
        explicit["top_p"] = spec.top_p
    if spec.top_k > 0:
        explicit["top_k"] = spec.top_k
    defaults = engine.llm.model_config.get_diff_sampling_param()
    defaults.pop("max_tokens", None)
    return SamplingParams(**{**defaults, **explicit})


# The callback that turns rollout completions into a scored row (the check's trainer side).
ScoreFn = Callable[[str, Ablation, object, list[RawCompletion], Path], object]


def run_ablation(
    base_config,
    model_dir: Path,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingSetup,
    score: ScoreFn,
    update_scale: float = 0.05,
    progress: Callable[[str], None] = print,
) -> list[object]:
    """Produce every row; `score(label, ablation, config, completions, weights_dir)` makes each one.

    Rows whose change is already part of the base configuration are skipped (they would repeat it).
    """
    rows: list[object] = []
    work = Path(tempfile.mkdtemp(prefix="parity-ablate-"))
    try:
        base = Ablation("base", "the configured settings", {})
        plan = [base] + [
            a for a in ABLATIONS if any(getattr(base_config, k) != v for k, v in a.changes.items())
        ]
        for ablation in plan:
            config = base_config.model_copy(update=ablation.changes)
            progress(f"ablation {ablation.name}: starting engine ({ablation.changes or 'base settings'})")
            if ablation.name == "prefix_cache_no_reset":
                rows.extend(_prefix_rows(config, model_dir, prompts, sampling, score, update_scale, work))
            elif ablation.name == "generation_config_auto":
                gen_dir = with_generation_defaults(model_dir, work / "with-generation-defaults")
                engine = start_engine(config, gen_dir, sampling.seed)
                try:
                    for row in (ablation, CONTROL_ROWS["generation_config_auto_openai"]):
                        completions = generate(engine, prompts, sampling, openai_style=row is not ablation)
                        rows.append(score(row.name, row, config, completions, model_dir))
                finally:
                    engine.shutdown_in_process()
            else:
                engine = start_engine(config, model_dir, sampling.seed)
                try:
                    completions = generate(engine, prompts, sampling)
                finally:
                    engine.shutdown_in_process()
                rows.append(score(ablation.name, ablation, config, completions, model_dir))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _prefix_rows(config, model_dir, prompts, sampling, score, update_scale, work) -> list[object]:
    """Prefill at the old weights, update without reset, resample; then reset and resample."""
    new_dir = perturbed_copy(model_dir, work / "updated", update_scale, seed=sampling.seed + 1)
    engine = start_engine(config, model_dir, sampling.seed, block_size=PREFIX_BLOCK_SIZE)
    resample = dataclasses.replace(sampling, seed=sampling.seed + 7)
    rows = []
    try:
        generate(engine, prompts, sampling)  # fills the prefix cache with old-weight KV
        # The service's swap, from a directory instead of a transfer; the config says: no reset.
        engine.update_weights_in_process(1, "parity_check_load_dir", model_dir=str(new_dir))
        stale = generate(engine, prompts, resample)
        engine.reset_prefix_cache_in_process()
        fresh = generate(engine, prompts, resample)
    finally:
        engine.shutdown_in_process()
    broken = next(a for a in ABLATIONS if a.name == "prefix_cache_no_reset")
    rows.append(score(broken.name, broken, config, stale, new_dir))
    control = CONTROL_ROWS["prefix_cache_reset"]
    rows.append(score(control.name, control, config.model_copy(update=control.changes), fresh, new_dir))
    return rows
