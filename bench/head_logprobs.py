"""The float32 head alone: Parity's chunked head (trainer/head.py) vs the whole [T, V] with autograd.

    python bench/head_logprobs.py [--vocab 151936 --hidden 1536 --tokens 512 --chunk_tokens 1024
                                   --grad_dtype float32|bfloat16 --weight_dtype float32|bfloat16
                                   --device cpu|cuda --repeats 3 --temperature 0.8 --top_p 0.95]

Both sides compute the logprobs of T sampled tokens under one processed transform (temperature,
top-p) from the hidden states and a float32 head weight of Qwen2.5-1.5B's size by default, then the
backward of a weighted sum into the hidden states and the head weight. `--weight_dtype float32` is
the trainer's fp32 mode (float32 hidden states); `bfloat16` its bf16 mode (bf16 hidden states, as the
bf16 decoder hands them over, and the bf16 copy of the head weight: on CUDA one tensor-core GEMM with
float32 output, parity/head_logits.py). "whole" is what the trainer did before: `F.linear` of the
upcast operands over all T rows, `processed_logprobs`, gather, autograd. Reported, per side:
median seconds of forward + backward, bytes autograd keeps for backward beyond the inputs (counted with
`torch.autograd.graph.saved_tensors_hooks`, the same on any device), and on CUDA the peak memory.
The last line is one JSON object with the ratios whole/ours (> 1: ours is faster or keeps less).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1_536)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk_tokens", type=int, default=1024)
    parser.add_argument("--grad_dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weight_dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps the default")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from parity.head_logits import tensor_core_path
    from parity.sampling import SamplingTransform, processed_logprobs
    from trainer.head import HeadOptions, TokenGroup, score_tokens
    from trainer.precision import disable_tf32

    if args.threads:
        torch.set_num_threads(args.threads)
    disable_tf32()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    weight_VH = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.02).to(device)
    weight_dtype = getattr(torch, args.weight_dtype)
    hidden_TH = torch.randn(args.tokens, args.hidden, generator=generator).to(device, weight_dtype)
    targets_T = torch.randint(0, args.vocab, (args.tokens,), generator=generator).to(device)
    transform = SamplingTransform(temperature=args.temperature, top_p=args.top_p)
    with torch.no_grad():  # sampled tokens are never masked: take each row's most likely token
        targets_T = F.linear(hidden_TH.float(), weight_VH).argmax(-1)
    grad_T = torch.linspace(-1.0, 1.0, args.tokens, device=device)
    options = HeadOptions(chunk_tokens=args.chunk_tokens, grad_dtype=args.grad_dtype)

    def whole(hidden, weight):
        lp_TV = processed_logprobs(F.linear(hidden.float(), weight.to(weight_dtype).float()), transform)
        return lp_TV.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1)

    def ours(hidden, weight):
        groups = (TokenGroup(transform, None),)
        return score_tokens(hidden, weight, None, targets_T, groups, False, options, weight_dtype)[0]

    def run(fn) -> tuple[float, int, float | None, torch.Tensor]:
        hidden = hidden_TH.clone().requires_grad_(True)
        weight = weight_VH.clone().requires_grad_(True)
        saved_bytes = 0

        def pack(tensor):  # what autograd keeps beyond the inputs (the head weight exists anyway)
            nonlocal saved_bytes
            if tensor.data_ptr() not in (hidden.data_ptr(), weight.data_ptr()):
                saved_bytes += tensor.numel() * tensor.element_size()
            return tensor

        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            lp_T = fn(hidden, weight)
        (lp_T * grad_T).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        return seconds, saved_bytes, peak, lp_T.detach()

    times: dict[str, list[float]] = {"whole": [], "ours": []}
    saved: dict[str, int] = {}
    peaks: dict[str, float | None] = {}
    max_abs = 0.0
    for round_index in range(args.repeats + 1):
        order = [("whole", whole), ("ours", ours)]
        results = {}
        for name, fn in order if round_index % 2 == 0 else order[::-1]:
            results[name] = run(fn)
        diff = float((results["whole"][3] - results["ours"][3]).abs().max())
        max_abs = diff if math.isnan(diff) or math.isnan(max_abs) else max(max_abs, diff)  # NaN sticks
        label = "warmup" if round_index == 0 else f"round {round_index}/{args.repeats}"
        print(
            f"{label}: whole {results['whole'][0]:.3f}s, ours {results['ours'][0]:.3f}s",
            flush=True,
        )
        for name in ("whole", "ours"):
            saved[name], peaks[name] = results[name][1], results[name][2]
            if round_index > 0:
                times[name].append(results[name][0])
    whole_s, ours_s = statistics.median(times["whole"]), statistics.median(times["ours"])
    summary = {
        "bench": "head_logprobs",
        "device": str(device),
        "vocab": args.vocab,
        "hidden": args.hidden,
        "tokens": args.tokens,
        "chunk_tokens": args.chunk_tokens,
        "grad_dtype": args.grad_dtype,
        "weight_dtype": args.weight_dtype,
        "tensor_core_forward": tensor_core_path(hidden_TH, weight_VH.to(weight_dtype)),
        "whole_s": round(whole_s, 4),
        "ours_s": round(ours_s, 4),
        "speed_ratio": round(whole_s / ours_s, 3),
        "whole_saved_gib": round(saved["whole"] / 2**30, 3),
        "ours_saved_gib": round(saved["ours"] / 2**30, 3),
        "saved_ratio": round(saved["whole"] / saved["ours"], 3),
        "whole_peak_gib": None if peaks["whole"] is None else round(peaks["whole"], 3),
        "ours_peak_gib": None if peaks["ours"] is None else round(peaks["ours"], 3),
        "max_abs_logprob_diff": max_abs,
        "repeats": args.repeats,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
