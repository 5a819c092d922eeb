"""Tokens/s of the trainer's update with packed micro-batches vs padded ones, same batch, same run.

    python bench/trainer_packing.py [--model tiny|smollm2-135m] [--groups 4 --group_size 8
        --prompt_len 16,64 --completion_len 8,256 --micro_batch_size 8 --micro_batch_tokens 2048
        --repeats 3 --threads 2 --device auto --precision fp32]

Three `trainer.loop.Trainer`s on one model directory, identical but for the micro-batching:
- `packed`: `trainer.packing=true` (the default): each micro-batch is one row, no padding, and a
  group's prompt written once per micro-batch (`trainer.share_prompts=true`, the default);
- `packed_unshared`: the same with `share_prompts=false`: each sample carries its own prompt copy;
- `padded_grouped`: `packing=false` with the same token budget (sequences sorted by length, a
  micro-batch holds at most `micro_batch_tokens` padded tokens);
- `padded`: `packing=false`, `micro_batch_tokens=0`: `micro_batch_size` sequences in arrival order.
Each round builds one batch of GRPO groups whose completion lengths are drawn uniformly from
`--completion_len LO,HI` (RL completions vary widely in length) and times `Trainer.update`
(forward with the fp32 head and replayed transform, loss, backward, clip, AdamW) of each variant on
it, the order rotating per round. Tokens/s counts completion tokens (what the step trains on); the
ratios are packed / padded (> 1: packing is faster) and packed / packed_unshared (what sharing the
prompt gives). Also reports the padding each padded variant
put through the model. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("packed", "packed_unshared", "padded_grouped", "padded")


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--prompt_len", type=_range, default=(16, 64))
    parser.add_argument("--completion_len", type=_range, default=(8, 256))
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--micro_batch_tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps the default")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args(argv)

    import torch

    from parity import models
    from parity.config import ParityConfig
    from tests.fakes.synthetic_rollouts import make_group
    from trainer.consumer import Batch
    from trainer.device import synchronize
    from trainer.loop import Trainer
    from trainer.packing import packed_tokens
    from trainer.policy import padded_tokens
    from trainer.prepare import prepare
    from trainer.step import split_micro_batches

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = models.resolve(args.model)
    run_root = Path(tempfile.mkdtemp(prefix="bench-packing-"))
    budgets = {name: args.micro_batch_tokens for name in VARIANTS} | {"padded": 0}
    trainers = {}
    try:
        for name in VARIANTS:
            config = ParityConfig.model_validate(
                {
                    "model": {"name": str(model_dir)},
                    # The bench trains one synthetic batch again and again: from the second step on its logprobs
                    # are older than the weights by design. The running gate is not what it measures.
                    "check": {"gate_threshold": 1e30},
                    "run": {"steps": 1, "max_lag": 1000},
                    "trainer": {
                        "run_dir": str(run_root / name),
                        "micro_batch_size": args.micro_batch_size,
                        "micro_batch_tokens": budgets[name],
                        "packing": name.startswith("packed"),
                        "share_prompts": name == "packed",
                        "lr": 1e-6,
                        "device": args.device,
                        "precision": args.precision,
                    },
                }
            )
            trainers[name] = Trainer(config)
            trainers[name].setup_model()
        reference = trainers["padded"].model
        gen = torch.Generator().manual_seed(0)
        rewards = [(1.0, 0.0) * (args.group_size // 2) + (1.0,) * (args.group_size % 2)]

        def make_batch(round_index: int) -> Batch:
            groups = []
            for g in range(args.groups):
                prompt_len = int(
                    torch.randint(args.prompt_len[0], args.prompt_len[1] + 1, (1,), generator=gen)
                )
                group = make_group(
                    reference,
                    f"r{round_index}g{g}",
                    rewards[0],
                    prompt_len=prompt_len,
                    completion_len=args.completion_len[1],
                    generator=gen,
                    sample=False,
                )
                for sample in group.samples:  # a causal prefix keeps its logprobs: cut to a random length
                    keep = int(
                        torch.randint(args.completion_len[0], args.completion_len[1] + 1, (1,), generator=gen)
                    )
                    del sample.token_ids[keep:]
                    del sample.logprobs[keep:]
                    del sample.token_weight_versions[keep:]
                groups.append(group)
            return Batch(groups=groups)

        wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
        through_model: dict[str, int] = {}
        tokens = 0
        for round_index in range(args.repeats + 1):
            batch = make_batch(round_index)
            line = []
            turn = round_index % len(VARIANTS)
            order = VARIANTS[turn:] + VARIANTS[:turn]
            for name in order:
                trainer = trainers[name]
                sequences = prepare(batch, trainer.config).sequences
                tokens = sum(len(s.rollout_logprobs) for s in sequences)
                chunks = split_micro_batches(
                    [s for s in sequences if s.trainable], trainer.config, trainer.device, distributed=False
                )
                inputs = [[s.inputs for s in c] for c in chunks]
                if name.startswith("packed"):
                    through_model[name] = sum(packed_tokens(c, name == "packed") for c in inputs)
                else:
                    through_model[name] = sum(padded_tokens(c) for c in inputs)
                synchronize(trainer.device)
                start = time.perf_counter()
                trainer.update(sequences)
                synchronize(trainer.device)
                seconds = time.perf_counter() - start
                if round_index:
                    wall[name].append(tokens / seconds)
                line.append(f"{name} {tokens / seconds:.0f} tok/s ({len(chunks)} micro-batches)")
            label = "warmup" if round_index == 0 else f"round {round_index}/{args.repeats}"
            print(f"{label}: {tokens} completion tokens; " + ", ".join(line), flush=True)
        median = {name: statistics.median(values) for name, values in wall.items()}
        unshared = through_model["packed_unshared"]  # real tokens, each prompt copy counted
        summary = {
            "bench": "trainer_packing",
            "model": args.model,
            "device": str(trainers["packed"].device),
            "precision": args.precision,
            "torch_threads": torch.get_num_threads(),
            "sequences_per_step": args.groups * args.group_size,
            "prompt_len": list(args.prompt_len),
            "completion_len": list(args.completion_len),
            "micro_batch_size": args.micro_batch_size,
            "micro_batch_tokens": args.micro_batch_tokens,
            "repeats": args.repeats,
            **{f"{name}_tokens_per_s": round(value, 1) for name, value in median.items()},
            "packed_vs_padded_grouped": round(median["packed"] / median["padded_grouped"], 3),
            "packed_vs_padded": round(median["packed"] / median["padded"], 3),
            "shared_vs_unshared": round(median["packed"] / median["packed_unshared"], 3),
            "shared_vs_unshared_per_round": [
                round(a / b, 3) for a, b in zip(wall["packed"], wall["packed_unshared"], strict=True)
            ],
            "tokens_through_model_shared_over_unshared": round(
                through_model["packed"] / through_model["packed_unshared"], 3
            ),
            "packed_vs_padded_grouped_per_round": [
                round(a / b, 3) for a, b in zip(wall["packed"], wall["padded_grouped"], strict=True)
            ],
            "packed_vs_padded_per_round": [
                round(a / b, 3) for a, b in zip(wall["packed"], wall["padded"], strict=True)
            ],
            "padding_fraction_padded_grouped": round(1 - unshared / through_model["padded_grouped"], 3),
            "padding_fraction_padded": round(1 - unshared / through_model["padded"], 3),
        }
        print(
            f"packed {median['packed']:.0f} tok/s; x{summary['packed_vs_padded_grouped']:.2f} vs padded+grouped "
            f"({100 * summary['padding_fraction_padded_grouped']:.0f}% padding), "
            f"x{summary['packed_vs_padded']:.2f} vs padded ({100 * summary['padding_fraction_padded']:.0f}% padding), "
            f"x{summary['shared_vs_unshared']:.2f} vs packed without shared prompts "
            f"({summary['tokens_through_model_shared_over_unshared']:.2f} of its tokens)",
            flush=True,
        )
        print(json.dumps(summary), flush=True)
    finally:
        shutil.rmtree(run_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
