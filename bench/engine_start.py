"""What a rollout service's start costs: `parity serve rollout --model tiny` until SERVING, with the
vLLM engine (on CPU in both executor layouts, `rollout.vllm_cpu_executor` uni and mp) and with the
reference engine (the baseline), alternated.

    .venv/bin/python bench/engine_start.py [--repeats 2] [--model tiny]

Wall time to SERVING, and the CPU time the whole machine spent meanwhile (/proc/stat: the service,
vLLM's engine-core process and, with mp, its worker process, and anything else running, so run it
on a quiet box).
The test suite starts a vLLM rollout service dozens of times, so on a CPU-bound 2-core box this is
most of what the suite's time is made of. Final stdout line: a JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.procs import start_service


def busy_cpu_s() -> float:
    """CPU seconds the machine has spent outside idle and iowait since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / 100.0  # USER_HZ is 100 on Linux


# what each row starts: the engine, and the executor layout for vLLM on CPU
VARIANTS = {
    "vllm": ["--engine", "vllm", "--vllm_cpu_executor", "uni"],
    "vllm-mp": ["--engine", "vllm", "--vllm_cpu_executor", "mp"],
    "reference": ["--engine", "reference"],
}


def one_start(variant: str, model: str) -> tuple[float, float]:
    log_dir = tempfile.mkdtemp(prefix=f"engine-start-{variant}-")
    busy, start = busy_cpu_s(), time.monotonic()
    service = start_service(
        "rollout", ["--model", model, *VARIANTS[variant], "--max_model_len", "256"], log_dir=log_dir, env={}
    )
    try:
        service.wait_ready(600)
        return time.monotonic() - start, busy_cpu_s() - busy
    finally:
        service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {variant: [] for variant in VARIANTS}
    for repeat in range(args.repeats):
        for engine in runs:
            wall, cpu = one_start(engine, args.model)
            runs[engine].append((wall, cpu))
            print(
                f"round {repeat + 1}/{args.repeats} {engine:9s}: SERVING in {wall:5.1f} s, machine CPU {cpu:5.1f} s"
            )
    result = {"bench": "engine_start", "model": args.model, "repeats": args.repeats}
    for engine, rows in runs.items():
        result[engine] = {"wall_s": [round(w, 1) for w, _ in rows], "cpu_s": [round(c, 1) for _, c in rows]}
    cpu = {variant: statistics.median(c for _, c in rows) for variant, rows in runs.items()}
    result["cpu_ratio_vllm_over_reference"] = round(cpu["vllm"] / cpu["reference"], 1)
    result["cpu_ratio_uni_over_mp"] = round(cpu["vllm"] / cpu["vllm-mp"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
