"""Tokens/s of one trainer step on SmolLM2-135M: Parity's step vs the same step in plain torch.

    python bench/trainer_step.py [--groups 2 --group_size 4 --prompt_len 16 --completion_len 48
                                  --repeats 3 --micro_batch_size 8 --model smollm2-135m
                                  --device auto|cpu|cuda --precision fp32|bf16]

"ours" is the real `trainer.loop.Trainer` step: XREADGROUP from a private redis-server, dedupe and
lag checks, fp32-head logprobs under the replayed sampling transform, GRPO/PPO-clip loss with
gradient accumulation, grad clip, AdamW, XACK, mismatch metrics (lag-0 and all), metrics.jsonl and
Prometheus gauges. "plain" is the same update written directly in torch: full-vocab logits from
`model(...)`, log_softmax / temperature, gather, the same GRPO advantages and PPO-clip loss, backward,
clip, AdamW — no queue, no replay of top-k/top-p, no metrics — on the same device and in the same
precision (bf16: autocast over the whole forward, fp32 weights and AdamW). Both see identical token batches and
share one model and optimizer; the runs alternate so that machine load hits both alike. The ratio
plain_tps / ours_tps is our overhead (>1 means we are slower). Prints progress lines; the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_redis() -> tuple[subprocess.Popen, str, str]:
    from parity.ports import free_port

    workdir = tempfile.mkdtemp(prefix="bench-redis-")
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0", workdir


def plain_step(
    model, optimizer, groups, micro_batch_size: int, device, precision: str, clip_eps: float = 0.2
) -> None:
    """The same GRPO/PPO-clip update, written plainly."""
    import contextlib

    import torch

    seqs = []
    for group in groups:
        rewards = torch.tensor([s.reward for s in group.samples])
        adv = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        for sample, a in zip(group.samples, adv.tolist(), strict=True):
            seqs.append((list(group.prompt_token_ids), list(sample.token_ids), list(sample.logprobs), a))
    total_tokens = sum(len(s[1]) for s in seqs)
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, len(seqs), micro_batch_size):
        chunk = seqs[start : start + micro_batch_size]
        length = max(len(p) + len(c) for p, c, _, _ in chunk)
        ids = torch.zeros(len(chunk), length, dtype=torch.long)
        mask = torch.zeros(len(chunk), length, dtype=torch.long)
        for b, (p, c, _, _) in enumerate(chunk):
            ids[b, : len(p) + len(c)] = torch.tensor(p + c)
            mask[b, : len(p) + len(c)] = 1
        autocast = (
            torch.autocast(device_type=device.type, dtype=torch.bfloat16)
            if precision == "bf16"
            else contextlib.nullcontext()
        )
        with autocast:
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        logprobs = (logits.float() / 1.0).log_softmax(-1)
        loss = 0.0
        for b, (p, c, old, a) in enumerate(chunk):
            positions = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=device)
            new = logprobs[b, positions, torch.tensor(c, device=device)]
            ratio = torch.exp(new - torch.tensor(old, device=device))
            loss = loss - torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a).sum()
        (loss / total_tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group_size", type=int, default=4)
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--completion_len", type=int, default=48)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps the default")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args(argv)

    import torch

    from parity import models
    from parity.config import ParityConfig
    from parity.rollout_queue import RolloutQueue
    from tests.fakes.synthetic_rollouts import make_group
    from trainer.device import synchronize
    from trainer.loop import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = models.resolve(args.model)
    redis_proc, redis_url, redis_dir = start_redis()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    try:
        print(f"loading {args.model} ({model_dir})", flush=True)
        config = ParityConfig.model_validate(
            {
                "model": {"name": str(model_dir)},
                "run": {
                    "redis_url": redis_url,
                    "stream": "bench:rollouts",
                    "steps": 10_000,
                    "groups_per_step": args.groups,
                    "max_lag": 1000,
                },
                "trainer": {
                    "run_dir": str(run_dir),
                    "micro_batch_size": args.micro_batch_size,
                    "lr": 1e-6,
                    "read_block_ms": 100,
                    "device": args.device,
                    "precision": args.precision,
                },
            }
        )
        trainer = Trainer(config)
        trainer.setup()
        # The plain step updates the same model with the same optimizer (one copy in memory; at
        # lr 1e-6 the drift between the two variants' weights is irrelevant to timing).
        plain_model, plain_opt = trainer.model, trainer.optimizer
        queue = RolloutQueue(redis_url, stream="bench:rollouts")
        gen = torch.Generator().manual_seed(0)
        reward_patterns = [(1.0, 0.0, 0.0, 1.0), (0.0, 1.0, 0.0, 0.0), (1.0, 1.0, 0.0, 1.0)]

        def make_batch(round_index: int) -> list:
            return [
                make_group(
                    trainer.model,
                    f"r{round_index}-g{g}",
                    [reward_patterns[(g + k) % 3][k % 4] for k in range(args.group_size)],
                    prompt_len=args.prompt_len,
                    completion_len=args.completion_len,
                    generator=gen,
                    sample=False,
                )
                for g in range(args.groups)
            ]

        tokens_per_step = args.groups * args.group_size * args.completion_len
        results: dict[str, list[float]] = {"ours": [], "plain": [], "ours_cpu": [], "plain_cpu": []}
        for round_index in range(args.repeats + 1):
            groups = make_batch(round_index)
            for group in groups:
                queue.publish(group)

            def run_ours() -> None:
                batch = trainer.consumer.collect(
                    args.groups, trainer.state.weight_version, config.run.max_lag
                )
                trainer.train_step(batch)

            def run_plain(groups: list = groups) -> None:
                plain_step(
                    plain_model, plain_opt, groups, args.micro_batch_size, trainer.device, args.precision
                )

            # Alternate which goes first, so that neither always meets the same load.
            order = [("ours", run_ours), ("plain", run_plain)]
            timings: dict[str, tuple[float, float]] = {}
            for name, fn in order if round_index % 2 == 0 else order[::-1]:
                synchronize(trainer.device)
                wall0, cpu0 = time.perf_counter(), time.process_time()
                fn()
                synchronize(trainer.device)
                timings[name] = (time.perf_counter() - wall0, time.process_time() - cpu0)
            label = "warmup" if round_index == 0 else f"round {round_index}/{args.repeats}"
            print(
                f"{label}: ours {timings['ours'][0]:.2f}s wall / {timings['ours'][1]:.2f}s cpu "
                f"({tokens_per_step / timings['ours'][0]:.1f} tok/s), plain {timings['plain'][0]:.2f}s wall / "
                f"{timings['plain'][1]:.2f}s cpu ({tokens_per_step / timings['plain'][0]:.1f} tok/s)",
                flush=True,
            )
            if round_index > 0:
                for name in ("ours", "plain"):
                    results[name].append(tokens_per_step / timings[name][0])
                    results[f"{name}_cpu"].append(tokens_per_step / timings[name][1])
        ours_tps = statistics.median(results["ours"])
        plain_tps = statistics.median(results["plain"])
        metrics = trainer.last_metrics
        summary = {
            "bench": "trainer_step",
            "model": args.model,
            "tokens_per_step": tokens_per_step,
            "sequences_per_step": args.groups * args.group_size,
            "prompt_len": args.prompt_len,
            "completion_len": args.completion_len,
            "ours_tokens_per_s": round(ours_tps, 1),
            "plain_tokens_per_s": round(plain_tps, 1),
            "overhead_ratio": round(plain_tps / ours_tps, 3),
            # CPU seconds of this process: far less sensitive to other jobs on a shared machine.
            "ours_tokens_per_cpu_s": round(statistics.median(results["ours_cpu"]), 1),
            "plain_tokens_per_cpu_s": round(statistics.median(results["plain_cpu"]), 1),
            "overhead_ratio_cpu": round(
                statistics.median(results["plain_cpu"]) / statistics.median(results["ours_cpu"]), 3
            ),
            "device": str(trainer.device),
            "precision": args.precision,
            "peak_memory_gib": metrics.get("peak_memory_gib"),
            "mfu": metrics.get("mfu"),
            "torch_threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "lag0_mismatch_k3": metrics.get("mismatch_k3"),
            "lag0_mismatch_max_abs": metrics.get("mismatch_max_abs"),
        }
        print(
            f"ours {ours_tps:.0f} tok/s vs plain {plain_tps:.0f} tok/s: overhead ratio "
            f"{summary['overhead_ratio']:.3f} (plain/ours; by CPU time {summary['overhead_ratio_cpu']:.3f})",
            flush=True,
        )
        print(json.dumps(summary), flush=True)
        trainer.close()
    finally:
        redis_proc.terminate()
        redis_proc.wait(10)
        shutil.rmtree(redis_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
