"""Tokens/s of one trainer step: Parity's step vs the same step in plain torch, per micro-batch size.

    python bench/trainer_step.py [--model smollm2-135m | --shape qwen2.5-1.5b [--num_layers N --vocab_size V]]
                                 [--groups 2 --group_size 4 --prompt_len 16 --completion_len 48
                                  --repeats 3 --micro_batch_size 8[,16...]
                                  --device auto|cpu|cuda --precision fp32|bf16
                                  --compile off|inductor|aot_eager --profile DIR]

"ours" is the real `trainer.loop.Trainer` step: XREADGROUP from a private redis-server, dedupe and
lag checks, fp32-head logprobs under the replayed sampling transform, GRPO/PPO-clip loss with
gradient accumulation, grad clip, AdamW, XACK, mismatch metrics (lag-0 and all), metrics.jsonl and
Prometheus gauges. "plain" is the same update written directly in torch: full-vocab logits from
`model(...)`, log_softmax / temperature, gather, the same GRPO advantages and PPO-clip loss, backward,
clip, AdamW — no queue, no replay of top-k/top-p, no metrics — on the same device and in the same
precision (bf16: autocast over the whole forward, fp32 weights and AdamW; the model is ours, so its
decoder layers also swap in bf16 casts of their weights, trainer/precision.py, as autocast would cast
them per matmul). Both see identical token batches and share one model and optimizer; the runs alternate so that machine load hits both alike. The ratio
plain_tps / ours_tps is our overhead (>1 means we are slower). Prints progress lines; the last
line is one JSON object.

`--shape` benches a randomly initialised model of a real architecture (bench/shapes.py), written
once into `--shape_dir` without the network. `--micro_batch_size 4,8` runs both sides at each size
in turn; `per_micro_batch` in the JSON has one entry per size (its `ratio` is ours/plain tokens/s),
and the top-level figures are the first size's. A side that runs out of memory at a size is
recorded as "oom" for that size (its figures null) and the bench goes on with the next size.
MFU counts the same model FLOPs for both sides — the trainer's 6 × non-embedding parameters per
token, over every sequence's prompt and completion — over each side's wall time and the device's
dense peak (trainer/device.py); null where the peak is unknown (CPU). Peak memory is CUDA's
allocator peak during each side's step, null on CPU.

`--compile inductor` benches ours with `trainer.compile` (trainer/compiled.py) against the same
eager plain step; each side's warm-up round (not counted in tokens/s) is `*_warmup_s`, so ours'
minus plain's is about the compile time.

`--profile DIR` adds one step of each side under torch.profiler after the first size's rounds
(bench/op_profile.py): DIR/ours_ops.txt and DIR/plain_ops.txt hold the top ops (by kernel time on
CUDA), and the JSON's `profile` has the same with ours' time per trainer stage and each side's
executed FLOPs; `flops_ratio` is ours ÷ plain. Not counted in tokens/s.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

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


REWARD_PATTERNS = ((1.0, 0.0, 0.0, 1.0), (0.0, 1.0, 0.0, 0.0), (1.0, 1.0, 0.0, 1.0))


def group_rewards(group: int, group_size: int) -> list[float]:
    """The synthetic rewards of the bench's group number `group`: never all equal.

    Ours skips the backward of a group whose rewards are all equal (zero advantage) and the plain
    step does not, which would flatter ours; so the last reward of such a group is flipped.
    """
    rewards = [REWARD_PATTERNS[(group + k) % 3][k % 4] for k in range(group_size)]
    if len(rewards) > 1 and len(set(rewards)) == 1:
        rewards[-1] = 1.0 - rewards[-1]
    return rewards


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


def eager_plain_step(model, optimizer, groups, micro_batch_size: int, device, precision: str) -> None:
    """`plain_step` with its layers eager: the model is shared, and ours may have compiled them."""
    import torch

    with torch.compiler.set_stance("force_eager"):
        plain_step(model, optimizer, groups, micro_batch_size, device, precision)


Status = Literal["ok", "oom"]


@dataclass(frozen=True)
class SideRun:
    """One side's step: "ok" with its times and CUDA peak memory (None on CPU), or "oom"."""

    status: Status
    wall_s: float | None = None
    cpu_s: float | None = None
    peak_memory_gib: float | None = None


@dataclass
class SideResults:
    """One side's measured rounds at one micro-batch size (the warm-up round is not recorded)."""

    status: Status = "ok"
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    peak_memory_gib: list[float] = field(default_factory=list)
    warmup_s: float | None = None  # the unrecorded first round (with --compile: the compile time too)


def micro_batch_sizes(text: str) -> list[int]:
    """`8` or `4,8,16` -> [4, 8, 16] (argparse type)."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"micro-batch sizes must be positive integers (got {text!r})")
    return sizes


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def free_memory(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Drop gradients and cached blocks after an out-of-memory step."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_side(
    step: Callable[[], None],
    device: torch.device,
    optimizer: torch.optim.Optimizer,
    after_oom: Callable[[], None] | None = None,
) -> SideRun:
    """Time `step` on `device`. Out of memory is a result ("oom"), after `after_oom` and
    `free_memory`; any other error propagates."""
    import torch

    from trainer.device import reset_peak_memory, synchronize

    synchronize(device)
    reset_peak_memory(device)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    out_of_memory = False
    try:
        step()
        synchronize(device)
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        if not is_out_of_memory(exc):
            raise
        out_of_memory = True
    if out_of_memory:
        # Freed outside the except block: by now the traceback, and the activations its frames held,
        # are gone.
        if after_oom is not None:
            after_oom()
        free_memory(optimizer, device)
        return SideRun("oom")
    wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return SideRun("ok", wall_s, cpu_s, peak)


def profile_sides(
    out_dir: Path,
    sides: dict[str, SideResults],
    make_batch: Callable[[str], list],
    queue: Any,
    run_ours: Callable[[], None],
    plain_model: Any,
    plain_opt: Any,
    size: int,
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One more step of each side that ran (not out of memory), under torch.profiler."""
    from bench.op_profile import profile_step, write_profile

    profiles: dict[str, Any] = {}
    groups = make_batch(f"profile-mb{size}")
    if sides["ours"].status == "ok":
        for group in groups:
            queue.publish(group)
        wall_s, averages = profile_step(run_ours, device)
        profiles["ours"] = write_profile(averages, wall_s, device, out_dir, "ours")
    if sides["plain"].status == "ok":
        run_plain = functools.partial(
            eager_plain_step, plain_model, plain_opt, groups, size, device, args.precision
        )
        wall_s, averages = profile_step(run_plain, device)
        profiles["plain"] = write_profile(averages, wall_s, device, out_dir, "plain")
    if (ratio := flops_ratio(profiles)) is not None:
        print(f"profile: ours executed {ratio:.3f}x plain's FLOPs (matmuls, add/mul; not attention)")
    for name, profile in profiles.items():
        stages = ", ".join(f"{k} {v['cpu']:.1f}" for k, v in profile["stages_ms"].items())
        top = ", ".join(f"{op['name']} {op['self_ms']:.1f}" for op in profile["top_ops"][:5])
        print(
            f"profile {name} ({profile['clock']} ms): wall {profile['wall_ms']:.1f}; {stages or 'no stages'}; top: {top}"
        )
    return profiles


def flops_ratio(profiles: dict[str, Any]) -> float | None:
    """Ours ÷ plain FLOPs executed in the profiled step; None unless both sides were counted."""
    ours, plain = (profiles.get(name, {}).get("flops") for name in ("ours", "plain"))
    return round(ours / plain, 4) if ours and plain else None


def model_flops_utilization(
    flops: float, seconds: float, device: torch.device, precision: str
) -> float | None:
    """`flops` done in `seconds` over the device's dense peak (trainer/device.py); None when unknown."""
    from trainer.device import peak_flops

    peak = peak_flops(device, precision)
    return flops / (seconds * peak) if peak is not None and seconds > 0 else None


def _tokens_per_s(side: SideResults, tokens_per_step: int, clock: Literal["wall", "cpu"]) -> float | None:
    """Median tokens/s over the measured rounds; None when the side ran out of memory."""
    seconds = side.wall_s if clock == "wall" else side.cpu_s
    if side.status != "ok" or not seconds:
        return None
    return statistics.median(tokens_per_step / t for t in seconds)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _progress(timing: SideRun | None, tokens_per_step: int) -> str:
    if timing is None:
        return "skipped (oom)"
    if timing.status == "oom":
        return "oom"
    return (
        f"{timing.wall_s:.2f}s wall / {timing.cpu_s:.2f}s cpu ({tokens_per_step / timing.wall_s:.1f} tok/s)"
    )


def size_summary(
    micro_batch_size: int,
    sides: dict[str, SideResults],
    tokens_per_step: int,
    flops_per_step: float,
    device: torch.device,
    precision: str,
) -> dict[str, Any]:
    """One `per_micro_batch` entry."""
    entry: dict[str, Any] = {"micro_batch_size": micro_batch_size}
    tps: dict[str, float | None] = {}
    for name, side in sides.items():
        tps[name] = _tokens_per_s(side, tokens_per_step, "wall")
        wall = statistics.median(side.wall_s) if tps[name] else None
        mfu = model_flops_utilization(flops_per_step, wall, device, precision) if wall else None
        entry[f"{name}_tokens_per_s"] = _round(tps[name], 1)
        entry[f"{name}_mfu"] = mfu
        peak = side.peak_memory_gib if tps[name] else []
        entry[f"{name}_peak_memory_gib"] = max(peak) if peak else None
        entry[f"{name}_status"] = side.status
        entry[f"{name}_warmup_s"] = _round(side.warmup_s, 3)
    ours, plain = tps["ours"], tps["plain"]
    entry["ratio"] = round(ours / plain, 3) if ours and plain else None
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="model.name (default smollm2-135m)")
    source.add_argument(
        "--shape", default=None, help="a named architecture from bench/shapes.py, randomly initialised"
    )
    parser.add_argument(
        "--shape_dir",
        default=None,
        help="where --shape is written or reused (default $PARITY_HOME/shapes/NAME[-Nlayers], "
        "PARITY_HOME defaulting to ~/.cache/parity)",
    )
    parser.add_argument(
        "--num_layers",
        type=int,
        default=None,
        help="with --shape: override its depth (for quick tests; no longer the real shape)",
    )
    parser.add_argument(
        "--vocab_size",
        type=int,
        default=None,
        help="with --shape: override its vocabulary (for quick tests; no longer the real shape)",
    )
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group_size", type=int, default=4)
    parser.add_argument("--prompt_len", type=int, default=16)
    parser.add_argument("--completion_len", type=int, default=48)
    parser.add_argument(
        "--micro_batch_size",
        type=micro_batch_sizes,
        default=[8],
        help="sequences per micro-batch; a comma list (4,8) benches each size in turn",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps the default")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument(
        "--compile",
        default="off",
        choices=["off", "inductor", "aot_eager"],
        help="trainer.compile for ours; plain stays eager (its warm-up round shows the compile time)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="after the first size's rounds, one more step of each side under torch.profiler: "
        "DIR/{ours,plain}_ops.txt and a `profile` entry in the JSON (bench/op_profile.py)",
    )
    args = parser.parse_args(argv)
    if args.num_layers is not None and args.shape is None:
        parser.error("--num_layers needs --shape")
    if args.vocab_size is not None and args.shape is None:
        parser.error("--vocab_size needs --shape")
    if args.shape_dir is not None and args.shape is None:
        parser.error("--shape_dir needs --shape")
    if args.group_size < 2:
        parser.error("--group_size must be at least 2: a group of one has no advantage to train on")

    import torch

    from bench import shapes
    from parity import models
    from parity.config import ParityConfig
    from parity.rollout_queue import RolloutQueue
    from tests.fakes.synthetic_rollouts import make_group
    from trainer.loop import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.shape is not None:
        try:
            shapes.get_shape(args.shape)
        except shapes.ShapeError as exc:
            parser.error(str(exc))
        shape_dir = args.shape_dir or shapes.default_dir(args.shape, args.num_layers, args.vocab_size)
        try:
            model_dir = shapes.write_shape(
                args.shape, shape_dir, num_layers=args.num_layers, vocab_size=args.vocab_size
            )
        except shapes.ShapeError as exc:
            parser.error(str(exc))
        model_label = args.shape
    else:
        model_label = args.model or "smollm2-135m"
        model_dir = models.resolve(model_label)
    redis_proc, redis_url, redis_dir = start_redis()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    try:
        print(f"loading {model_label} ({model_dir})", flush=True)
        config = ParityConfig.model_validate(
            {
                "model": {"name": str(model_dir)},
                # The bench trains one synthetic batch again and again: from the second step on its logprobs
                # are older than the weights by design. The running gate is not what it measures.
                "check": {"gate_threshold": 1e30},
                "run": {
                    "redis_url": redis_url,
                    "stream": "bench:rollouts",
                    "steps": 10_000,
                    "groups_per_step": args.groups,
                    "max_lag": 1000,
                },
                "trainer": {
                    "run_dir": str(run_dir),
                    "micro_batch_size": args.micro_batch_size[0],
                    "lr": 1e-6,
                    "read_block_ms": 100,
                    "device": args.device,
                    "precision": args.precision,
                    "compile": args.compile,
                },
            }
        )
        trainer = Trainer(config)
        trainer.setup()
        # The plain step updates the same model with the same optimizer (one copy in memory; at
        # lr 1e-6 the drift between the two variants' weights is irrelevant to timing).
        plain_model, plain_opt = trainer.model, trainer.optimizer
        device = trainer.device
        queue = RolloutQueue(redis_url, stream="bench:rollouts")
        gen = torch.Generator().manual_seed(0)

        def make_batch(batch_id: str) -> list:
            # Rollout ids are unique over the whole bench: the trainer skips ids it has trained on.
            return [
                make_group(
                    trainer.model,
                    f"{batch_id}-g{g}",
                    group_rewards(g, args.group_size),
                    prompt_len=args.prompt_len,
                    completion_len=args.completion_len,
                    generator=gen,
                    sample=False,
                )
                for g in range(args.groups)
            ]

        sequences_per_step = args.groups * args.group_size
        tokens_per_step = sequences_per_step * args.completion_len
        flops_per_step = (
            trainer.flops_per_token * sequences_per_step * (args.prompt_len + args.completion_len)
        )
        per_size: list[dict[str, Any]] = []
        profiles: dict[str, Any] = {}
        first_size_results: dict[str, SideResults] = {}
        first_size_metrics: dict[str, Any] = {}
        taken: list = []  # the batch ours collected, until its step finishes

        def run_ours() -> None:
            batch = trainer.consumer.collect(args.groups, trainer.state.weight_version, config.run.max_lag)
            taken.append(batch)
            trainer.train_step(batch)
            taken.clear()

        def ack_taken() -> None:
            # An out-of-memory step never acked its batch: ack it now, so that no later read
            # (XAUTOCLAIM of pending entries) hands the next size this size's rollouts.
            for batch in taken:
                trainer.queue.ack(batch.all_entry_ids())
            taken.clear()

        for size_index, size in enumerate(args.micro_batch_size):
            trainer.config = trainer.config.model_copy(update={"micro_batch_size": size})
            sides = {"ours": SideResults(), "plain": SideResults()}
            for round_index in range(args.repeats + 1):
                groups = make_batch(f"s{size_index}-mb{size}-r{round_index}")
                if sides["ours"].status == "ok":
                    for group in groups:
                        queue.publish(group)

                run_plain = functools.partial(
                    eager_plain_step, plain_model, plain_opt, groups, size, device, args.precision
                )

                # Alternate which goes first, so that neither always meets the same load.
                order = [("ours", run_ours, ack_taken), ("plain", run_plain, None)]
                timings: dict[str, SideRun | None] = {}
                for name, fn, after_oom in order if round_index % 2 == 0 else order[::-1]:
                    side = sides[name]
                    if side.status == "oom":
                        timings[name] = None
                        continue
                    timings[name] = timing = run_side(fn, device, trainer.optimizer, after_oom)
                    if timing.status == "oom":
                        side.status = "oom"
                    elif round_index == 0:
                        side.warmup_s = timing.wall_s
                    else:
                        side.wall_s.append(timing.wall_s)
                        side.cpu_s.append(timing.cpu_s)
                        if timing.peak_memory_gib is not None:
                            side.peak_memory_gib.append(timing.peak_memory_gib)
                label = "warmup" if round_index == 0 else f"round {round_index}/{args.repeats}"
                print(
                    f"mb {size} {label}: ours {_progress(timings['ours'], tokens_per_step)}, "
                    f"plain {_progress(timings['plain'], tokens_per_step)}",
                    flush=True,
                )
                if all(side.status == "oom" for side in sides.values()):
                    break
            per_size.append(
                size_summary(size, sides, tokens_per_step, flops_per_step, device, args.precision)
            )
            if size_index == 0:
                first_size_results = sides
                first_size_metrics = dict(trainer.last_metrics) if sides["ours"].status == "ok" else {}
                if args.profile is not None:
                    profiles = profile_sides(
                        args.profile,
                        sides,
                        make_batch,
                        queue,
                        run_ours,
                        plain_model,
                        plain_opt,
                        size,
                        device,
                        args,
                    )

        first = first_size_results
        ours_tps = _tokens_per_s(first["ours"], tokens_per_step, "wall")
        plain_tps = _tokens_per_s(first["plain"], tokens_per_step, "wall")
        ours_cpu = _tokens_per_s(first["ours"], tokens_per_step, "cpu")
        plain_cpu = _tokens_per_s(first["plain"], tokens_per_step, "cpu")
        metrics = first_size_metrics
        summary = {
            "bench": "trainer_step",
            "model": model_label,
            **(
                {
                    "shape": args.shape,
                    "num_layers": trainer.model.config.num_hidden_layers,
                    "vocab_size": trainer.model.config.vocab_size,
                }
                if args.shape
                else {}
            ),
            "tokens_per_step": tokens_per_step,
            "sequences_per_step": sequences_per_step,
            "prompt_len": args.prompt_len,
            "completion_len": args.completion_len,
            "ours_tokens_per_s": _round(ours_tps, 1),
            "plain_tokens_per_s": _round(plain_tps, 1),
            "overhead_ratio": round(plain_tps / ours_tps, 3) if ours_tps and plain_tps else None,
            # CPU seconds of this process: far less sensitive to other jobs on a shared machine.
            "ours_tokens_per_cpu_s": _round(ours_cpu, 1),
            "plain_tokens_per_cpu_s": _round(plain_cpu, 1),
            "overhead_ratio_cpu": round(plain_cpu / ours_cpu, 3) if ours_cpu and plain_cpu else None,
            "device": str(device),
            "precision": args.precision,
            "compile": args.compile,
            "peak_memory_gib": metrics.get("peak_memory_gib"),
            "mfu": metrics.get("mfu"),
            "torch_threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "lag0_mismatch_k3": metrics.get("mismatch_k3"),
            "lag0_mismatch_max_abs": metrics.get("mismatch_max_abs"),
            "per_micro_batch": per_size,
            **({"profile": profiles} if args.profile is not None else {}),
            **({"flops_ratio": flops_ratio(profiles)} if args.profile is not None else {}),
        }
        for entry in per_size:
            ours, plain = (
                f"{entry[f'{name}_tokens_per_s']} tok/s" if entry[f"{name}_status"] == "ok" else "oom"
                for name in ("ours", "plain")
            )
            print(
                f"mb {entry['micro_batch_size']}: ours {ours} vs plain {plain} (ours/plain {entry['ratio']})"
            )
        print(
            f"overhead ratio (plain/ours, first size) {summary['overhead_ratio']} "
            f"(by CPU time {summary['overhead_ratio_cpu']})",
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
