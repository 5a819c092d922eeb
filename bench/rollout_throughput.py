"""Rollout throughput: raw in-process AsyncLLM vs our gRPC service vs HF generate, one run.

    .venv/bin/python bench/rollout_throughput.py [--model smollm2-135m] [--prompts 8] [--n 4]
        [--max_tokens 64] [--clients 8] [--rounds 3]

Same prompts (the arithmetic task through the chat template, `prompts x n` = 32 sequences by
default), same engine settings (RolloutConfig defaults: fp32, processed logprobs, fp32 head, the
bounded top-k/top-p masking of rollout/cpu_top_p.py, installed in the raw engine too), same
per-request seeds, so the raw engine and the service generate the same tokens:
  1. raw: `AsyncLLM.generate` in this process, one request per group, all concurrent;
  2. service: `parity serve rollout` as a subprocess, `clients` concurrent gRPC clients sharing the
     groups (each a thread with its own channel), unary Generate;
  3. HF: `model.generate` on the whole batch (left-padded, do_sample, same temperature/top-p).
The raw engine and the service are both up at once and measured in alternating rounds; service/raw
is the median of the per-round ratios, so background load on a shared machine hits both alike. Tokens/s counts generated tokens
(EOS ends a sequence early in all three). Goals: service / raw >= 0.95, vLLM / HF >= 5.
Final stdout line: a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEMPERATURE, TOP_P = 1.0, 0.95


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def build_prompts(model_dir: Path, num_prompts: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rollout.tasks import get_task
    from rollout.vllm_engine import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [encode_prompt(tokenizer, p.text, True) for p in get_task("arithmetic").eval_prompts(num_prompts)]


async def raw_round(llm, prompts: list[list[int]], n: int, max_tokens: int) -> tuple[int, float]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    async def one(i: int, ids: list[int]) -> int:
        params = SamplingParams(
            n=n, temperature=TEMPERATURE, top_p=TOP_P, max_tokens=max_tokens, logprobs=0, seed=1000 + i,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip
        final = None
        async for out in llm.generate(
            {"prompt_token_ids": ids}, params, request_id=f"raw-{time.time_ns()}-{i}"
        ):
            final = out
        return sum(len(c.token_ids) for c in final.outputs)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))
    return tokens, time.perf_counter() - start


def service_round(
    address: str, prompts: list[list[int]], n: int, max_tokens: int, clients: int
) -> tuple[int, float]:
    import grpc

    from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    work = list(enumerate(prompts))
    lock = threading.Lock()
    counts: list[int] = []

    def client() -> None:
        with grpc.insecure_channel(address) as chan:
            stub = rollout_pb2_grpc.RolloutServiceStub(chan)
            while True:
                with lock:
                    if not work:
                        return
                    i, ids = work.pop(0)
                reply = stub.Generate(
                    rollout_pb2.GenerateRequest(
                        prompt_token_ids=ids,
                        sampling=common_pb2.SamplingParams(
                            temperature=TEMPERATURE, top_p=TOP_P, max_tokens=max_tokens, n=n, seed=1000 + i
                        ),
                    ),
                    timeout=600,
                )
                with lock:
                    counts.append(sum(len(c.token_ids) for c in reply.completions))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - start


def hf_round(
    model_dir: Path, prompts: list[list[int]], n: int, max_tokens: int, threads: int
) -> tuple[int, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)

    from parity.models import quiet_loading

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(n)]
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Progress(StoppingCriteria):
        def __init__(self) -> None:
            self.steps = 0

        def __call__(self, input_ids, scores, **kwargs) -> bool:
            self.steps += 1
            if self.steps % 16 == 0:
                elapsed = time.perf_counter() - start
                log(
                    f"  HF step {self.steps}/{max_tokens}: {self.steps * len(rows) / elapsed:.1f} tok/s (padded)"
                )
            return False

    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P,
            top_k=0, max_new_tokens=max_tokens, pad_token_id=pad,
            stopping_criteria=StoppingCriteriaList([Progress()]),
        )  # fmt: skip
    elapsed = time.perf_counter() - start
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])  # fmt: skip
    tokens = 0
    for row in out[:, width:].tolist():
        for tok in row:
            tokens += 1
            if tok in eos:
                break
    return tokens, elapsed


async def main_async(args: argparse.Namespace) -> dict:
    from parity import models
    from parity.config.rollout import RolloutConfig
    from parity.procs import start_service
    from rollout.vllm_engine import VllmEngine, build_async_llm

    model_dir = models.resolve(args.model)
    prompts = build_prompts(model_dir, args.prompts)
    sequences = args.prompts * args.n
    log(
        f"{args.model}: {args.prompts} prompts x n={args.n} = {sequences} sequences, max_tokens={args.max_tokens}"
    )
    service = start_service(
        "rollout", ["--model", args.model, "--max_model_len", "512", "--max_n", str(max(16, args.n))],
        name="bench-rollout",
    )  # fmt: skip
    log(f"started the rollout service (log: {service.log_path}); starting the raw AsyncLLM in-process")
    config = RolloutConfig(max_model_len=512)
    engine_args = VllmEngine(config, model_dir).engine_args()
    llm = build_async_llm(engine_args)  # the service's executor layout (rollout.vllm_cpu_executor)
    # the same top-k/top-p masking the service's engine installs (RolloutConfig.cpu_top_p)
    top_p_impl = (await llm.collective_rpc("parity_install_top_p", kwargs={"mode": config.cpu_top_p}))[0]
    try:
        await asyncio.to_thread(service.wait_ready, 900)
        log("both engines up; warm-up")
        await raw_round(llm, prompts[:2], args.n, 8)
        await asyncio.to_thread(service_round, service.address, prompts[:2], args.n, 8, 2)
        raw_rates, service_rates = [], []
        for r in range(args.rounds):
            tokens, elapsed = await raw_round(llm, prompts, args.n, args.max_tokens)
            raw_rates.append(tokens / elapsed)
            log(
                f"round {r + 1}/{args.rounds} raw AsyncLLM: {tokens} tokens in {elapsed:.2f}s = {tokens / elapsed:.1f} tok/s"
            )
            tokens, elapsed = await asyncio.to_thread(
                service_round, service.address, prompts, args.n, args.max_tokens, args.clients
            )
            service_rates.append(tokens / elapsed)
            log(f"round {r + 1}/{args.rounds} gRPC service ({args.clients} clients): {tokens} tokens in "
                f"{elapsed:.2f}s = {tokens / elapsed:.1f} tok/s")  # fmt: skip
    finally:
        llm.shutdown()
        # AsyncLLM sits in reference cycles: collected at interpreter exit, its __del__ would call
        # shutdown again with vLLM's module globals already gone (a TypeError printed at exit).
        del llm
        gc.collect()
        service.stop()
    log(f"HF generate (same prompts, batch of all sequences, torch threads {args.hf_threads or 'default'})")
    hf_tokens, hf_elapsed = hf_round(model_dir, prompts, args.n, args.max_tokens, args.hf_threads)
    hf_rate = hf_tokens / hf_elapsed
    log(f"HF generate: {hf_tokens} tokens in {hf_elapsed:.2f}s = {hf_rate:.1f} tok/s")
    raw_rate, service_rate = statistics.median(raw_rates), statistics.median(service_rates)
    # Rounds alternate raw/service, so the per-round ratio cancels slow drifts in machine load.
    pair_ratio = statistics.median(s / r for s, r in zip(service_rates, raw_rates, strict=True))
    result = {
        "model": args.model,
        "sequences": sequences,
        "max_tokens": args.max_tokens,
        "clients": args.clients,
        "rounds": args.rounds,
        "raw_tokens_per_s": round(raw_rate, 1),
        "service_tokens_per_s": round(service_rate, 1),
        "hf_tokens_per_s": round(hf_rate, 1),
        "hf_threads": args.hf_threads or None,
        "service_over_raw": round(pair_ratio, 3),
        "service_over_raw_of_medians": round(service_rate / raw_rate, 3),
        "raw_rounds_tokens_per_s": [round(x, 1) for x in raw_rates],
        "service_rounds_tokens_per_s": [round(x, 1) for x in service_rates],
        "vllm_over_hf": round(service_rate / hf_rate, 2),
        "goal_service_over_raw": 0.95,
        "goal_vllm_over_hf": 5.0,
        "settings": config.parity_settings(args.model),
        "raw_top_p_impl": top_p_impl,
    }
    log(f"service/raw = {result['service_over_raw']:.3f} (goal >= 0.95); "
        f"vLLM service/HF = {result['vllm_over_hf']:.2f}x (goal >= 5)")  # fmt: skip
    return result


def workload_parser(description: str) -> argparse.ArgumentParser:
    """The workload flags every rollout benchmark shares: model, prompts x n sequences, length."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=64)
    return parser


def main() -> int:
    parser = workload_parser(__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hf_threads", type=int, default=0, help="torch threads for HF (0: torch default)")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
