"""How far the bf16 trainer's logprobs are from a bf16 engine's, per way of running the decoder.

    python bench/bf16_forward.py [--model tiny | smollm2-135m] [--sequences 8 --prompt_len 24 --completion_len 40]
                                 [--device cpu | cuda]

The engine side is what the reference engine computes in bf16: the HF model loaded in bfloat16,
the prompt prefilled into a KV cache, then one token at a time (the completion teacher-forced), with
float32 logits from its own bf16 head weight (an fp32 head, as vLLM's `head_dtype float32`). The
trainer side scores the same sequences in one forward over the float32 weights:
- "ours": the trainer's bf16 scorer (trainer/precision.py: bf16 casts of the weights, the head's
  included, bf16 activations throughout, float32 logits);
- "autocast": the same forward under torch.autocast(bfloat16) (bf16 matmuls over a float32
  residual stream, the common way to train in bf16) with a float32 head on the float32 weight; the
  baseline of the ratio.
Per side: k3 = mean(exp(r) - 1 - r) with r the
trainer-minus-engine logprob, and max |r|, over every completion token; `ratio` is autocast's k3 ÷
ours (> 1: ours is closer to the engine). What remains for ours is the engine's token-by-token
bf16 arithmetic against one forward over the sequence. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def engine_logprobs(model, prompt: list[int], completion: list[int]):
    """Logprob of each completion token, decoded token by token by the bf16 `model` (KV cache), its
    float32 logits from its own bf16 head weight."""
    import torch

    from parity.head_logits import float32_logits

    out = []
    with torch.no_grad():
        head_weight = model.lm_head.weight
        device = head_weight.device
        step = model.model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        for token in completion:
            logits = float32_logits(step.last_hidden_state[0, -1], head_weight)
            out.append(logits.log_softmax(-1)[token])
            step = model.model(
                input_ids=torch.tensor([[token]], device=device),
                past_key_values=step.past_key_values,
                use_cache=True,
            )
    return torch.stack(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=24)
    parser.add_argument("--completion_len", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps the default")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)

    import torch

    from parity import models
    from parity.sampling import SamplingTransform
    from trainer.policy import SequenceInput, load_model, scorer_for, token_logprobs
    from trainer.precision import disable_tf32

    if args.threads:
        torch.set_num_threads(args.threads)
    disable_tf32()  # as the trainer and the reference engine run: float32 matmuls in full float32
    model_dir = models.resolve(args.model)
    engine = load_model(model_dir, "bfloat16", args.device).eval()
    ours_model = load_model(model_dir, device=args.device).eval()
    autocast_model = load_model(model_dir, device=args.device).eval()
    vocab = ours_model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    sequences = [
        SequenceInput(
            tuple(torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()),
            tuple(torch.randint(3, vocab, (args.completion_len,), generator=gen).tolist()),
            SamplingTransform(),
        )
        for _ in range(args.sequences)
    ]
    print(
        f"{args.model}: {args.sequences} sequences of {args.prompt_len}+{args.completion_len} tokens",
        flush=True,
    )
    engine_T = torch.cat(
        [engine_logprobs(engine, list(s.prompt_ids), list(s.completion_ids)) for s in sequences]
    )
    with torch.no_grad():
        ours_T, _ = token_logprobs(scorer_for(ours_model, "bf16"), sequences)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            autocast_T, _ = token_logprobs(scorer_for(autocast_model, "fp32"), sequences)
    summary: dict = {
        "bench": "bf16_forward",
        "model": args.model,
        "device": args.device,
        "tokens": int(engine_T.numel()),
    }
    for name, side_T in (("ours", ours_T), ("autocast", autocast_T)):
        r = (side_T - engine_T).double()
        summary[f"{name}_k3"] = float((r.exp() - 1 - r).mean())
        summary[f"{name}_max_abs"] = float(r.abs().max())
        print(f"{name}: k3 {summary[f'{name}_k3']:.2e}, max |Δ| {summary[f'{name}_max_abs']:.2e}", flush=True)
    summary["ratio"] = summary["autocast_k3"] / summary["ours_k3"] if summary["ours_k3"] > 0 else None
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
