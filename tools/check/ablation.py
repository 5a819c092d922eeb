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
  - Engine arguments come from the shipped builder (`rollout.vllm_engine.VllmEngine.engine_args`),
    so every row runs the settings a rollout service would run. The engines run in this process
    (`vllm.LLM`, in-process engine core, uniprocess executor): ~5 s to start instead of ~30-60 s for
    an AsyncLLM with its engine and worker processes, which is what makes six engines affordable.
  - The weight update of the prefix rows goes through the worker extension's `reload_weights`, the
    same call the rollout service's update path makes after its transfer; the new weights are the
    base weights plus seeded Gaussian noise (`update_scale` x each tensor's std). Prompts are
    prefilled at the old weights first, then resampled at the new ones. vLLM caches only full KV
    blocks and the CPU default block is 128 tokens, longer than our prompts, so these rows use 32
    tokens (the smallest the CPU attention backend accepts; vLLM's GPU default is 16): with 128 the
    stale KV would be hidden on CPU, not absent on GPU.
  - tiny and SmolLM2 ship no sampling defaults in generation_config.json, so the generation_config
    rows use a copy of the model whose generation_config.json carries Qwen2.5-Instruct-style
    defaults (GENERATION_DEFAULTS). Parity's engine passes explicit SamplingParams, which vLLM does
    not merge with those defaults; a client of vLLM's OpenAI server that omits a field gets them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from rollout.worker_extension import ParityWorkerExtension

# What Qwen2.5-*-Instruct ship in generation_config.json: a realistic set of hidden sampling defaults.
GENERATION_DEFAULTS = {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
PREFIX_BLOCK_SIZE = 32
CHECK_WORKER_EXTENSION = "tools.check.ablation.CheckWorkerExtension"


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


@contextlib.contextmanager
def _in_process_vllm() -> Iterator[None]:
    """vLLM's engine core in this process (no engine/worker processes) for the duration."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


class InProcessEngine:
    """A `vllm.LLM` built from the rollout service's own engine arguments, in this process."""

    def __init__(self, config, model_dir: Path, block_size: int | None = None) -> None:
        from vllm import LLM, AsyncEngineArgs

        from rollout.vllm_engine import VllmEngine

        self.config = config
        self.version = 0
        self.shipped = VllmEngine(config, model_dir)
        args = self.shipped.engine_args()
        defaults = AsyncEngineArgs(model=args.model)
        kwargs = {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(args)
            if getattr(args, f.name) != getattr(defaults, f.name) or f.name == "model"
        }
        kwargs.update(worker_extension_cls=CHECK_WORKER_EXTENSION, distributed_executor_backend="uni")
        if block_size is not None:
            kwargs["block_size"] = block_size
        with _in_process_vllm():
            self.llm = LLM(**kwargs)

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSetup, openai_style: bool = False
    ) -> list[RawCompletion]:
        """Sample `samples_per_prompt` completions per prompt, seeded per prompt."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from rollout.engine import GenerationSpec

        params = []
        for i, prompt in enumerate(prompts):
            spec = GenerationSpec(
                request_id=f"check-{i}",
                prompt_token_ids=list(prompt),
                n=sampling.samples_per_prompt,
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                seed=sampling.seed * 100_003 + i,
            )
            if openai_style:
                # The request names only the fields that differ from the OpenAI API's neutral values;
                # the server fills the rest from the model's generation config.
                explicit = {
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
                defaults = self.llm.llm_engine.model_config.get_diff_sampling_param()
                defaults.pop("max_tokens", None)
                p = SamplingParams(**{**defaults, **explicit})
            else:
                p = self.shipped.sampling_params(spec)
                p.output_kind = RequestOutputKind.FINAL_ONLY
            params.append(p)
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        if self.config.prefix_caching and self.config.reset_prefix_cache_on_update:
            for request in requests:  # the service salts the cache by version, as here
                request["cache_salt"] = f"v{self.version}"
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = []
        for i, output in enumerate(outputs):
            for comp in output.outputs:
                ids = tuple(int(t) for t in comp.token_ids)
                lps = tuple(
                    float(entry[t].logprob) for entry, t in zip(comp.logprobs or [], ids, strict=True)
                )
                completions.append(RawCompletion(prompt_index=i, token_ids=ids, logprobs=lps))
        return completions

    def load_weights_from(self, model_dir: Path) -> None:
        """Swap in new weights the way the service's update does; reset the prefix cache if configured."""
        self.version += 1
        (reply,) = self.llm.collective_rpc(
            "parity_check_load_dir", kwargs={"model_dir": str(model_dir), "version": self.version}
        )
        if reply["error"]:
            raise RuntimeError(f"weight update failed: {reply['error']}")
        if self.config.reset_prefix_cache_on_update:
            self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache")

    def close(self) -> None:
        import gc

        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()


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
                engine = InProcessEngine(config, gen_dir)
                try:
                    for row in (ablation, CONTROL_ROWS["generation_config_auto_openai"]):
                        completions = engine.generate(prompts, sampling, openai_style=row is not ablation)
                        rows.append(score(row.name, row, config, completions, model_dir))
                finally:
                    engine.close()
            else:
                engine = InProcessEngine(config, model_dir)
                try:
                    completions = engine.generate(prompts, sampling)
                finally:
                    engine.close()
                rows.append(score(ablation.name, ablation, config, completions, model_dir))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _prefix_rows(config, model_dir, prompts, sampling, score, update_scale, work) -> list[object]:
    """Prefill at the old weights, update without reset, resample; then reset and resample."""
    new_dir = perturbed_copy(model_dir, work / "updated", update_scale, seed=sampling.seed + 1)
    engine = InProcessEngine(config, model_dir, block_size=PREFIX_BLOCK_SIZE)
    rows = []
    try:
        engine.generate(prompts, sampling)  # fills the prefix cache with old-weight KV
        engine.load_weights_from(new_dir)  # config says: no reset
        stale = engine.generate(prompts, dataclasses.replace(sampling, seed=sampling.seed + 7))
        engine.reset_prefix_cache()
        fresh = engine.generate(prompts, dataclasses.replace(sampling, seed=sampling.seed + 7))
    finally:
        engine.close()
    broken = next(a for a in ABLATIONS if a.name == "prefix_cache_no_reset")
    rows.append(score(broken.name, broken, config, stale, new_dir))
    control = CONTROL_ROWS["prefix_cache_reset"]
    rows.append(score(control.name, control, config.model_copy(update=control.changes), fresh, new_dir))
    return rows
