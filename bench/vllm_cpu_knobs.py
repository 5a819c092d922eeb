"""Where vLLM's CPU decode time goes: the same 32 sequences under sampling variants, one engine.

    .venv/bin/python bench/vllm_cpu_knobs.py [--eager 1] [--prompts 8] [--n 4] [--max_tokens 64]
    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv/bin/python bench/vllm_cpu_knobs.py   # worker on every core
    .venv/bin/python bench/vllm_cpu_knobs.py --cpu_top_p sort   # vLLM's own full-vocab sort

One in-process `vllm.LLM` with the rollout service's engine settings (RolloutConfig defaults: fp32,
processed logprobs, fp32 head); prompts and sampling as in bench/rollout_throughput.py. Each variant
changes one thing against the baseline (T=1, top-p 0.95, one logprob, per-group seed) and is timed
after a warm-up, so the ratios say what each part of the sampling path costs per step:
  baseline | no_seed | no_logprobs | no_top_p.
`--eager 0` lets vLLM compile the model (torch.compile) instead of running it eagerly.
Final stdout line: a JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rollout_throughput import TEMPERATURE, TOP_P, build_prompts, log, workload_parser

VARIANTS = {
    "baseline": {},
    "no_seed": {"seed": None},
    "no_logprobs": {"logprobs": None},
    "no_top_p": {"top_p": 1.0},
}
ENGINE_FIELDS = (
    "model", "tokenizer", "dtype", "max_model_len", "enable_prefix_caching", "logprobs_mode", "hf_overrides",
    "generation_config", "async_scheduling", "seed", "enforce_eager", "max_num_seqs", "disable_log_stats",
    "worker_extension_cls",
)  # fmt: skip


def sampling(variant: dict, index: int, n: int, max_tokens: int):
    from vllm import SamplingParams

    fields = {"temperature": TEMPERATURE, "top_p": TOP_P, "logprobs": 0, "seed": 1000 + index, **variant}
    return SamplingParams(n=n, max_tokens=max_tokens, **{k: v for k, v in fields.items() if v is not None})


def main() -> int:
    parser = workload_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--eager", type=int, default=1, help="1: enforce_eager (the service default); 0: compile"
    )
    parser.add_argument(
        "--cpu_top_p", choices=["bounded", "sort"], default="bounded", help="RolloutConfig.cpu_top_p"
    )
    args = parser.parse_args()

    from vllm import LLM

    from parity import models
    from parity.config.rollout import RolloutConfig
    from rollout.vllm_engine import VllmEngine

    model_dir = models.resolve(args.model)
    prompts = [{"prompt_token_ids": ids} for ids in build_prompts(model_dir, args.prompts)]
    config = RolloutConfig(max_model_len=512, enforce_eager=bool(args.eager))
    engine_args = VllmEngine(config, model_dir).engine_args()
    start = time.perf_counter()
    llm = LLM(**{name: getattr(engine_args, name) for name in ENGINE_FIELDS})
    startup_s = time.perf_counter() - start
    top_p_impl = llm.collective_rpc("parity_install_top_p", kwargs={"mode": args.cpu_top_p})[0]
    log(f"engine up in {startup_s:.1f}s (enforce_eager={bool(args.eager)}, "
        f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}, "
        f"top-k/top-p masking {top_p_impl})")  # fmt: skip
    rates = {}
    for name, variant in VARIANTS.items():
        params = [sampling(variant, i, args.n, args.max_tokens) for i in range(len(prompts))]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        rates[name] = tokens / elapsed
        log(f"{name:>12}: {tokens} tokens in {elapsed:.2f}s = {rates[name]:.1f} tok/s "
            f"({rates[name] / rates['baseline']:.2f}x baseline)")  # fmt: skip
    result = {
        "benchmark": "vllm_cpu_knobs",
        "model": args.model,
        "sequences": len(prompts) * args.n,
        "enforce_eager": bool(args.eager),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "top_p_impl": top_p_impl,
        "startup_s": round(startup_s, 1),
        "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
        "over_baseline": {k: round(v / rates["baseline"], 2) for k, v in rates.items()},
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
