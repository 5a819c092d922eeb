"""`parity check --faults`: every fault class of the catalogue (parity/faults.py), injected into an
in-process run, when the running gate caught it and what its localisation named.

Each run: the real `trainer.loop.Trainer` on the tiny model (or `--model`), a private
redis-server, and two `rollout.faults.ReferenceEngine` workers (worker-0, worker-1) that load the
trainer's weights after every update and each sample one group per step at the trainer's version
(temperature 0.8, top-k 40, top-p 0.95). The fault is active from weight version
`--inject_version` (version v is trained at step v + 1). The running gate runs with gate_steps 1,
on_mismatch stop and `--threshold`, so "caught at" is the step at which the gate stopped the run; a
clean control runs the same steps and must not be caught.

    parity check --faults [--fault_classes A,B] [--fault_model tiny] [--check.out DIR]
    python -m bench.faults [--steps 4] [--inject_version 2] [--threshold 1e-6] [--seed 0] [--out DIR]
                           [--faults A,B] [--model tiny]

Passes (exit 0) when the control is never caught and every class is caught at the first step that
trains on a faulty token with the class among its localisation's three most likely.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from parity.sampling import SamplingTransform
from rollout.faults import FAULTS, MULTI_TURN_FAULTS, FaultSpec, ReferenceEngine

TRANSFORM = SamplingTransform(0.8, 40, 0.95)
STREAM = "bench:faults"
WORKERS = 2  # one group per worker per step
PROMPT_LEN, LENGTH, REWARDS = 8, 8, (1.0, 0.0, 0.0, 1.0)
OBSERVATION_LEN = 4  # multi-turn runs: the environment's tokens between the two model turns
MULTI_TURN_CONTROL = "clean (multi-turn control)"


@dataclass(frozen=True)
class FaultResult:
    fault: str
    injected_step: int | None  # first step that trains on a faulty token
    caught_step: int | None
    signal: str
    steps_run: int
    likely: tuple[str, ...] = ()  # the localiser's top classes when the gate fired
    where: str = ""


def run_fault(
    name: str | None,
    model_dir: Path,
    redis_url: str,
    run_dir: Path,
    steps: int = 4,
    inject_version: int = 2,
    threshold: float = 1e-6,
    seed: int = 0,
    multi_turn: bool | None = None,
) -> FaultResult:
    """One in-process run with fault `name` (None: clean control). Samples are two-turn episodes
    when `multi_turn` (None: when the class is one of MULTI_TURN_FAULTS)."""
    import torch

    from parity.config import ParityConfig
    from parity.rollout_queue import RolloutQueue
    from trainer.head_watch import HEAD_TEST
    from trainer.loop import Trainer
    from trainer.mismatch_gate import GATED_METRIC, MismatchGateError
    from trainer.mismatch_locate import MISMATCH_REPORT

    config = ParityConfig.model_validate(
        {
            "model": {"name": str(model_dir)},
            "run": {"redis_url": redis_url, "stream": STREAM, "steps": steps, "groups_per_step": WORKERS,
                    "max_lag": 1},
            "trainer": {"run_dir": str(run_dir), "micro_batch_size": 4, "lr": 1e-3, "read_block_ms": 50},
            "check": {"gate_threshold": threshold, "gate_steps": 1, "on_mismatch": "stop"},
        }
    )  # fmt: skip
    trainer = Trainer(config)
    trainer.setup()
    queue = RolloutQueue(redis_url, stream=STREAM)
    spec = FaultSpec(FAULTS[name], inject_version) if name else None
    if multi_turn is None:
        multi_turn = name in MULTI_TURN_FAULTS
    tokenizer = None
    if multi_turn:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engines = [ReferenceEngine(trainer.model, spec, f"worker-{i}", tokenizer) for i in range(WORKERS)]
    generator = torch.Generator().manual_seed(seed)
    vocab = trainer.model.get_output_embeddings().weight.shape[0]
    injected = caught = None
    likely: tuple[str, ...] = ()
    where = ""
    clean_max: float | None = None  # the gated metric's largest value on the steps that passed
    measured = 0  # steps that passed with the gated metric measured (some informative token)
    signal = ""
    try:
        for step in range(1, steps + 1):
            version = trainer.state.weight_version
            for engine in engines:
                engine.update(version, trainer.model.state_dict())
                prompt = [int(t) for t in torch.randint(3, vocab, (PROMPT_LEN,), generator=generator)]
                observation = (
                    [int(t) for t in torch.randint(3, vocab, (OBSERVATION_LEN,), generator=generator)]
                    if multi_turn
                    else []
                )
                group = engine.group(
                    f"s{step}-{engine.worker_id}", prompt, REWARDS, TRANSFORM, LENGTH, generator, observation
                )
                queue.publish(group)
            # The first step with a faulty token; a multi-turn class only has one where it changed a
            # turn (the round trip changed some context; an update landed between turns).
            faulty = spec is not None and spec.active(version)
            if name in MULTI_TURN_FAULTS:
                faulty = faulty and sum(e.faulty_turns for e in engines) > 0
            if faulty and injected is None:
                injected = step
            batch = trainer.consumer.collect(WORKERS, version, 1, lambda: False)
            if batch is None:
                raise RuntimeError(f"step {step}: no batch collected")
            try:
                metrics = trainer.train_step(batch)
            except MismatchGateError as exc:
                caught = step
                where = str(exc).partition("Localisation: ")[2]
                metrics = trainer.last_metrics
                signal = (
                    f"head_grid_exponent={metrics['head_grid_exponent']:g} ({metrics['head_gaps']} gaps)"
                    if str(exc).startswith(HEAD_TEST)  # the running head test, not the k3 gate
                    else f"{GATED_METRIC}={metrics[GATED_METRIC]:.2e}"
                )
                written = run_dir / f"{MISMATCH_REPORT}.json"
                if written.exists():  # the trainer's own localisation, written when the gate fired
                    report = json.loads(written.read_text())
                    likely = tuple(c["fault"] for c in report["candidates"][:3])
                break
            value = metrics.get(GATED_METRIC)
            if value is not None and math.isfinite(value):  # a step with no informative token: not measured
                clean_max = value if clean_max is None else max(clean_max, value)
                measured += 1
            trainer._publish()  # as Trainer.run does after every step (publish_every 1)
        else:
            signal = (
                f"not caught; max {clean_max:.2e} ({measured} of {step} steps measured)"
                if clean_max is not None
                else f"not caught; none of {step} steps measured"
            )
    finally:
        trainer.close()
    label = name or (MULTI_TURN_CONTROL if multi_turn else "clean (control)")
    return FaultResult(label, injected, caught, signal, step, likely, where)


def markdown(results: list[FaultResult], threshold: float) -> str:
    lines = [
        f"Gate: `{threshold:g}` on k3 over informative own-version tokens, gate_steps 1.",
        "",
        "| class | site | injected at step | caught at step | signal | most likely (localiser) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        site = FAULTS[r.fault].site if r.fault in FAULTS else "-"
        injected = "-" if r.injected_step is None else str(r.injected_step)
        caught = "not caught" if r.caught_step is None else str(r.caught_step)
        likely = ", ".join(f"**{c}**" if c == r.fault else c for c in r.likely) or "-"
        lines.append(f"| {r.fault} | {site} | {injected} | {caught} | {r.signal} | {likely} |")
    return "\n".join(lines) + "\n"


def passed(results: list[FaultResult]) -> bool:
    """Every control never caught; every class caught at its first faulty step and named."""
    controls = [r for r in results if r.fault not in FAULTS]
    faults = [r for r in results if r.fault in FAULTS]
    return all(r.caught_step is None for r in controls) and all(
        r.caught_step is not None and r.caught_step == r.injected_step and r.fault in r.likely for r in faults
    )


def class_names(value: str) -> list[str] | None:
    """A comma-separated list of fault classes; None (every class) when it names none."""
    return [n.strip() for n in value.split(",") if n.strip()] or None


def run_catalogue(
    out: Path,
    names: list[str] | None = None,
    steps: int = 4,
    inject_version: int = 2,
    threshold: float = 1e-6,
    seed: int = 0,
    progress=print,
    model: str = "tiny",
) -> list[FaultResult]:
    """The control (and a multi-turn control when a multi-turn class is run) and each class in
    turn on `model` (run directories, reports included, under `out`); writes faults.md and
    faults.json there."""
    from parity import models
    from parity.procs import start_redis, stop_groups

    names = names or list(FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(
            f"check.fault_classes: unknown fault {', '.join(unknown)}; known: {', '.join(FAULTS)}"
        )
    try:
        model_dir = models.resolve(model)  # a built-in name, a model directory or a Hub id, as model.name
    except models.ModelError as exc:
        raise ValueError(f"check.fault_model: {exc}") from exc
    out.mkdir(parents=True, exist_ok=True)
    redis_child, redis_url = start_redis(
        Path(tempfile.mkdtemp(prefix="parity-faults-redis-")), password="", die_with_launcher=True
    )
    start = time.perf_counter()
    results = []
    runs: list[tuple[str | None, bool | None]] = [(None, False)]
    if any(n in MULTI_TURN_FAULTS for n in names):
        runs.append((None, True))
    runs += [(n, None) for n in names]
    try:
        for index, (name, multi_turn) in enumerate(runs):
            run_dir = out / (name or ("clean-multi-turn" if multi_turn else "clean"))
            shutil.rmtree(run_dir, ignore_errors=True)
            result = run_fault(
                name, model_dir, redis_url, run_dir, steps, inject_version, threshold, seed, multi_turn
            )
            results.append(result)
            # Each run's Trainer and engines sit in reference cycles: collect them before the next
            # run (tiny, 27 runs: peak RSS 815 MB without this, 556 MB with it).
            gc.collect()
            caught = "not caught" if result.caught_step is None else f"caught at step {result.caught_step}"
            progress(
                f"[{index + 1}/{len(runs)}] {result.fault}: {caught}"
                + (f"; most likely {', '.join(result.likely)}" if result.likely else "")
            )
            subprocess.run(
                ["redis-cli", "-u", redis_url, "FLUSHALL"], check=True, capture_output=True, timeout=30
            )
    finally:
        stop_groups([redis_child], grace_s=2.0)
    seconds = time.perf_counter() - start
    (out / "faults.md").write_text(
        markdown(results, threshold) + f"\n{len(results)} runs in {seconds:.0f} s\n"
    )
    (out / "faults.json").write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--inject_version", type=int, default=2)
    parser.add_argument("--threshold", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the sampling")
    parser.add_argument("--faults", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--model", default="tiny", help="tiny (default), smollm2-135m, or a model directory")
    parser.add_argument(
        "--out", default="", help="run directories, reports and faults.md here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="parity-faults-"))
    names = class_names(args.faults)
    results = run_catalogue(
        out, names, args.steps, args.inject_version, args.threshold, args.seed, model=args.model
    )
    print(markdown(results, args.threshold))
    print(f"wrote {out}/faults.md, faults.json and each class's run directory")
    return 0 if passed(results) else 1


if __name__ == "__main__":
    sys.exit(main())
