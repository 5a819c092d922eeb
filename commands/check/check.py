"""`parity check`: rollout-engine logprobs against the trainer's, same weights, same prompts.

    parity check --model tiny                          # start a rollout service with the switches, check it
    parity check --rollout_address 127.0.0.1:PORT      # check a running rollout service (the launcher's gate)
    parity check --model tiny --ablate --out DIR       # one row per correctness fix turned off
    parity check --faults --out DIR                    # every fault class injected, caught, localised

A fixed, seeded prompt set (the task's first `num_prompts` training prompts, through the chat
template) is tokenized here and sent as token ids, so both sides see identical prompts. The
rollout side samples `samples_per_prompt` completions per prompt; the trainer side is
`trainer.policy.token_logprobs` (fp32 head, the replayed sampling transform) on the same tokens.

Gate: a configuration passes when no logprob is non-finite, mean k3 <= threshold, and the engine's
logits were float32: the rollout side also returns each token's top logprobs, whose gaps lie on a
power-of-two grid when the logits were rounded to bfloat16/float16 (`parity.head_lattice`; under bf16
rollouts a bf16 head hides inside the body's own mismatch, so k3 alone misses it). Exit codes:
0 passed, 1 above the threshold (or non-finite), 2 bad input. With --ablate only the first row
(the configured settings) decides the exit code; the other rows are expected to fail.

Default threshold 1e-3 (mean k3 per token). For small r, k3 ≈ r²/2, so 1e-3 is an RMS log-ratio
of ~0.045: per-token importance ratios off by ~4.5% on average, a quarter of PPO's clip range
(0.2), so the trust region still means what the objective assumes. Measured on SmolLM2-135M
(docs/ab_study.md): fp32 rollouts 3e-11; bf16 with the fp32 head 8e-4 (passes); bf16 with a bf16
head 1.2e-3 (fails); raw logprobs at temperature 0.7 5.6e-2; stale prefix-cache KV 4.5e-2.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from commands.check.ablation import TOP_LOGPROBS, Ablation, RawCompletion, SamplingSetup
from commands.check.report import (
    ScoredCompletion,
    WorstToken,
    completion_log_ratios,
    completion_stats,
    format_table,
    format_worst,
    worst_tokens,
)
from parity.config import ConfigError, ParityConfig, env_for, write_config
from parity.config.entry import entrypoint
from parity.config.task import TaskConfig
from parity.head_lattice import HeadLattice, head_lattice
from parity.mismatch import MismatchStats

PARITY_SWITCHES = (
    "dtype",
    "logprobs_mode",
    "head_dtype",
    "prefix_caching",
    "reset_prefix_cache_on_update",
    "generation_config",
)


def check_sampling(config: ParityConfig) -> SamplingSetup:
    """What the check samples: the `check` section's settings, seeded by run.seed."""
    c = config.check
    return SamplingSetup(c.temperature, c.top_p, c.top_k, c.max_tokens, c.samples_per_prompt, config.run.seed)


@dataclass
class CheckRow:
    """One configuration's measurement."""

    name: str
    description: str
    settings: dict[str, object]
    stats: MismatchStats
    worst: list[WorstToken]
    log_ratios: list[float] = field(repr=False)
    passed: bool
    compare_with: str = ""
    head: HeadLattice | None = None  # the head-precision test on the engine's top logprobs

    def as_dict(self) -> dict[str, object]:
        return {
            **_attributes(self, "name", "description", "compare_with", "settings", "passed"),
            "stats": self.stats.as_dict(),
            "head": None if self.head is None else self.head.as_dict(),
            "worst_tokens": [w.as_dict() for w in self.worst],
        }


@dataclass
class CheckReport:
    """The check's result. rows[0] is the configuration under test; it alone decides `passed`."""

    rows: list[CheckRow]
    threshold: float
    model: str
    source: str
    sampling: SamplingSetup
    num_prompts: int
    seconds: float

    @property
    def passed(self) -> bool:
        return self.rows[0].passed

    @property
    def table(self) -> str:
        rows = [(r.name, r.stats, _verdict(r)) for r in self.rows]
        s = self.sampling
        head = (
            f"parity check: {self.model} via {self.source}; {self.num_prompts} prompts x "
            f"{s.samples_per_prompt} samples, max_tokens {s.max_tokens}, temperature {s.temperature}, "
            f"top_p {s.top_p}, top_k {s.top_k}, seed {s.seed}; gate: no non-finite, mean k3 <= "
            f"{self.threshold:g} and float32 logits"
        )
        settings = ", ".join(f"{k}={v}" for k, v in self.rows[0].settings.items())
        verdict = "PASSED" if self.passed else "FAILED"
        tail = f"{self.rows[0].name}: {verdict} (mean k3 {self.rows[0].stats.k3:.3g}, threshold {self.threshold:g})"
        first = f"{self.rows[0].name} settings: {settings}"
        lines = [head, first, format_table(rows), format_worst(self.rows[0].worst[:5])]
        if self.rows[0].head is not None:
            lines.append(f"{self.rows[0].name}: {self.rows[0].head.describe()}")
        return "\n".join([*lines, tail])

    def as_dict(self) -> dict[str, object]:
        return {
            **_attributes(self, "passed", "threshold", "model", "source"),
            "sampling": asdict(self.sampling),
            **_attributes(self, "num_prompts", "seconds"),
            "rows": [r.as_dict() for r in self.rows],
        }


def _attributes(obj: object, *names: str) -> dict[str, object]:
    """check.json's plain fields of `obj`, in the order given."""
    return {name: getattr(obj, name) for name in names}


def _verdict(row: CheckRow) -> str:
    if row.passed:
        return "pass"
    if row.stats.nonfinite_tokens:
        return "FAIL (non-finite)"
    return "FAIL (head)" if row.head is not None and row.head.low_precision else "FAIL"


def check_prompts(
    model_dir: Path, task_config: TaskConfig, num_prompts: int, seed: int
) -> tuple[list[list[int]], object]:
    """The task's first `num_prompts` training prompts as token ids, rendered as the actor renders
    them (the task's source options, `task.chat_template`, `task.system_prompt`), and the tokenizer."""
    from transformers import AutoTokenizer

    from rollout.tasks import get_task
    from rollout.tasks.chat import needs_tokenizer, request_text, token_ids
    from rollout.vllm_engine import encode_prompt

    task = get_task(task_config.name, seed, task_config)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    template, system = task_config.chat_template, task_config.system_prompt
    stream = task.train_prompts()
    prompts = []
    for _ in range(num_prompts):
        prompt = next(stream)
        if needs_tokenizer(prompt, template, system):
            prompts.append(token_ids(tokenizer, prompt, template, system))
        else:  # what the engine encodes from the actor's prompt_text
            prompts.append(encode_prompt(tokenizer, request_text(prompt, template, system), template))
    return prompts, tokenizer


class TrainerSide:
    """The trainer's logprobs (trainer.policy: fp32 head, replayed transform), one model per weights dir."""

    def __init__(self, batch_size: int = 16) -> None:
        self.batch_size = batch_size
        self._models: dict[Path, object] = {}

    def score(
        self,
        weights_dir: Path,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[RawCompletion],
        sampling: SamplingSetup,
    ) -> list[ScoredCompletion]:
        import torch

        from parity.sampling import SamplingTransform
        from trainer.policy import SequenceInput, load_model, token_logprobs

        if weights_dir not in self._models:
            self._models = {weights_dir: load_model(weights_dir)}  # keep one model in memory
        model = self._models[weights_dir]
        transform = SamplingTransform(sampling.temperature, sampling.top_k, sampling.top_p)
        kept = [c for c in completions if c.token_ids]
        scored: list[ScoredCompletion] = []
        for start in range(0, len(kept), self.batch_size):
            batch = kept[start : start + self.batch_size]
            seqs = [SequenceInput(tuple(prompts[c.prompt_index]), c.token_ids, transform) for c in batch]
            with torch.no_grad():
                trainer_lp, _ = token_logprobs(model, seqs, with_entropy=False)
            offset = 0
            for c in batch:
                n = len(c.token_ids)
                scored.append(
                    ScoredCompletion(
                        c.prompt_index,
                        tuple(prompts[c.prompt_index]),
                        c.token_ids,
                        c.logprobs,
                        tuple(float(x) for x in trainer_lp[offset : offset + n]),
                    )
                )
                offset += n
        return scored


def make_row(
    name: str,
    description: str,
    settings: dict,
    scored: list[ScoredCompletion],
    tokenizer,
    threshold: float,
    compare_with: str = "",
    head: HeadLattice | None = None,
) -> CheckRow:
    stats = completion_stats(scored)
    low_head = head is not None and head.low_precision
    decode = lambda ids: tokenizer.decode(list(ids))  # noqa: E731
    return CheckRow(
        name=name,
        description=description,
        settings=settings,
        stats=stats,
        worst=worst_tokens(scored, decode),
        log_ratios=completion_log_ratios(scored).tolist(),
        passed=stats.nonfinite_tokens == 0 and stats.k3 <= threshold and not low_head,  # NaN k3 fails too
        compare_with=compare_with,
        head=head,
    )


def completions_head(completions: Sequence[RawCompletion], sampling: SamplingSetup) -> HeadLattice | None:
    """The head-precision test on the completions' top logprobs; None when none were returned."""
    tops = [top for c in completions for top in c.top_logprobs]
    return head_lattice(tops, sampling.temperature) if tops else None


def service_rollouts(
    address: str, prompts: Sequence[Sequence[int]], sampling: SamplingSetup, timeout_s: float = 600.0
) -> tuple[list[RawCompletion], dict[str, object]]:
    """Generate through a running rollout service (all prompts in flight at once); and its settings."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    with grpc.insecure_channel(address) as chan:
        stub = rollout_pb2_grpc.RolloutServiceStub(chan)
        status = stub.GetStatus(rollout_pb2.RolloutServiceGetStatusRequest(), timeout=30.0)
        futures = [
            stub.Generate.future(
                rollout_pb2.GenerateRequest(
                    request_id=f"check-{i}",
                    prompt_token_ids=list(p),
                    sampling=common_pb2.SamplingParams(
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        top_k=sampling.top_k,
                        max_tokens=sampling.max_tokens,
                        n=sampling.samples_per_prompt,
                        seed=sampling.seed * 100_003 + i + 1,  # 0 would mean unseeded
                        top_logprobs=TOP_LOGPROBS,
                    ),
                ),
                timeout=timeout_s,
            )
            for i, p in enumerate(prompts)
        ]
        completions = []
        for i, fut in enumerate(futures):
            for comp in fut.result().completions:
                tops = tuple(tuple(top.logprobs) for top in comp.top_logprobs)
                completions.append(RawCompletion(i, tuple(comp.token_ids), tuple(comp.logprobs), tops))
    settings = MessageToDict(
        status.settings, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    settings["weight_version"] = int(status.weight_version)
    return completions, settings


def _require_version_zero(address: str) -> None:
    """The trainer side scores with the checkpoint on disk, which is weight version 0."""
    import grpc

    from parity.v1 import rollout_pb2, rollout_pb2_grpc

    with grpc.insecure_channel(address) as chan:
        status = rollout_pb2_grpc.RolloutServiceStub(chan).GetStatus(
            rollout_pb2.RolloutServiceGetStatusRequest(), timeout=30.0
        )
    if status.weight_version != 0:
        raise ConfigError(
            f"rollout_address: {address} serves weight version {status.weight_version}; the check compares "
            "against the checkpoint on disk (version 0), so run it before training"
        )


def run_check(config: ParityConfig) -> CheckReport:
    """Run the check (and the ablation with check.ablate); write outputs when check.out is set."""
    from parity import models

    check = config.check
    if check.ablate and config.rollout.engine != "vllm":
        raise ConfigError("check.ablate: the ablation switches are vLLM settings; use --rollout.engine vllm")
    if check.ablate and check.rollout_address:
        raise ConfigError("check.ablate: the ablation starts its own engines; drop --check.rollout_address")
    started = time.perf_counter()
    model_dir = models.resolve(config.model.name)
    prompts, tokenizer = check_prompts(model_dir, config.task, check.num_prompts, config.run.seed)
    sampling = check_sampling(config)
    trainer = TrainerSide()
    if check.ablate:
        rows, source = _ablation_rows(config, model_dir, prompts, sampling, trainer, tokenizer)
    else:
        completions, settings, source = _rollout_side(config, prompts, sampling)
        scored = trainer.score(model_dir, prompts, completions, sampling)
        rows = [
            make_row(
                "configured",
                "the rollout engine as configured",
                settings,
                scored,
                tokenizer,
                check.threshold,
                head=completions_head(completions, sampling),
            )
        ]
    report = CheckReport(
        rows,
        check.threshold,
        config.model.name,
        source,
        sampling,
        check.num_prompts,
        time.perf_counter() - started,
    )
    if check.out:
        write_outputs(report, Path(check.out))
    return report


def _rollout_side(config: ParityConfig, prompts, sampling) -> tuple[list[RawCompletion], dict, str]:
    address = config.check.rollout_address
    if address:
        _require_version_zero(address)
        completions, settings = service_rollouts(address, prompts, sampling)
        return completions, settings, f"rollout service at {address}"
    import secrets
    import tempfile

    from parity.config.loader import CONFIG_FILE_ENV
    from parity.procs import start_service

    # The service reads the same config (its rollout section is the engine under test), from a file.
    log_dir = Path(tempfile.mkdtemp(prefix="parity-check-"))
    max_n = max(config.rollout.max_n, config.check.samples_per_prompt)
    service_config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"max_n": max_n})})
    env = {CONFIG_FILE_ENV: str(write_config(service_config, log_dir / "config.toml"))}
    env.update(env_for("observability", log_level=config.observability.log_level))
    # a token of its own, as `parity run` gives its services: no other local user can change its
    # weights (UpdateWeights) or pause it while the check reads it; the check only calls Generate
    env.update(env_for("rollout", auth_token=secrets.token_hex(16)))
    service = start_service("rollout", [], log_dir=log_dir, env=env, name="check-rollout")
    try:
        service.wait_ready(config.run.startup_timeout_s)
        completions, settings = service_rollouts(service.address, prompts, sampling)
    finally:
        service.stop()
    return completions, settings, f"a rollout service started for the check ({config.rollout.engine})"


def _ablation_rows(
    config, model_dir, prompts, sampling, trainer: TrainerSide, tokenizer
) -> tuple[list[CheckRow], str]:
    from commands.check.ablation import run_ablation

    def score(name: str, ablation: Ablation, rollout_cfg, completions, weights_dir: Path) -> CheckRow:
        scored = trainer.score(weights_dir, prompts, completions, sampling)
        settings = {k: getattr(rollout_cfg, k) for k in PARITY_SWITCHES}
        return make_row(
            name,
            ablation.description,
            settings,
            scored,
            tokenizer,
            config.check.threshold,
            ablation.compare_with if name != "base" else "",
            head=completions_head(completions, sampling),
        )

    rows = run_ablation(
        config.rollout,
        model_dir,
        prompts,
        sampling,
        score,
        config.check.update_scale,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return rows, "the rollout service's engine (VllmEngine), one per row, in this process"


def write_outputs(report: CheckReport, out: Path) -> None:
    """check.json, check.txt (the table) and check_hist.png (|Δlogprob| histogram per configuration)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "check.json").write_text(json.dumps(report.as_dict(), indent=2, default=float) + "\n")
    (out / "check.txt").write_text(report.table + "\n")
    plot_histogram(report, out / "check_hist.png")


def plot_histogram(report: CheckReport, path: Path):
    """One panel per configuration: |r| on log-spaced bins (exact zeros in the first bin)."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    floor, ceil = 1e-9, 1e2
    bins = np.logspace(np.log10(floor), np.log10(ceil), 56)
    ncols = 1 if len(report.rows) == 1 else 2
    nrows = math.ceil(len(report.rows) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 2.4 * nrows + 1), sharex=True, squeeze=False)
    for ax, row in zip(axes.flat, report.rows, strict=False):
        r = np.clip(np.abs(np.asarray(row.log_ratios, dtype=np.float64)), floor, ceil)
        color = "tab:green" if row.passed else "tab:red"
        ax.hist(r, bins=bins, color=color, alpha=0.75)
        ax.axvline(math.sqrt(2 * report.threshold), color="gray", linestyle="--", linewidth=1)
        ax.set_title(
            f"{row.name}: k3 {row.stats.k3:.2g}, non-finite {row.stats.nonfinite_tokens} ({_verdict(row)})",
            fontsize=9,
        )
        ax.set_xscale("log")
        ax.set_ylabel("tokens", fontsize=8)
    for ax in axes.flat[len(report.rows) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("|Δlogprob| = |logp_trainer - logp_rollout| (finite tokens)")
    fig.suptitle(
        f"parity check: {report.model}, temperature {report.sampling.temperature}, top_p {report.sampling.top_p}, "
        f"top_k {report.sampling.top_k}  (dashed: |Δ| whose k3 equals the threshold)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    return entrypoint("parity check", "check", list(sys.argv[1:] if argv is None else argv), _main)


def _main(config: ParityConfig) -> int:
    if not config.check.out:
        out = f"checks/{datetime.now(UTC):%Y%m%d-%H%M%S}"
        config = config.model_copy(update={"check": config.check.model_copy(update={"out": out})})
    if config.check.faults:
        return _faults(config)
    import grpc

    from parity.models import ModelError

    try:
        report = run_check(config)
    except (ConfigError, ValueError, ModelError) as exc:
        print(f"parity check: error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"parity check: error: rollout service: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    print(report.table)
    print(f"wrote {config.check.out}/check.json, check.txt, check_hist.png ({report.seconds:.0f}s)")
    return 0 if report.passed else 1


def _faults(config: ParityConfig) -> int:
    from commands.check.faults import class_names, markdown, passed, run_catalogue

    if config.check.ablate or config.check.rollout_address:
        print("parity check: error: check.faults runs its own engines; drop --ablate and --rollout_address",
              file=sys.stderr)  # fmt: skip
        return 2
    out = Path(config.check.out)
    names = class_names(config.check.fault_classes)
    # model.name describes the engine a plain check tests; the catalogue's runs have their own model.
    print(f"parity check --faults: in-process runs on {config.check.fault_model} (check.fault_model)")
    try:
        results = run_catalogue(
            out, names, threshold=1e-6, seed=config.run.seed, model=config.check.fault_model
        )
    except ValueError as exc:  # an unknown class or model, named
        print(f"parity check: error: {exc}", file=sys.stderr)
        return 2
    print(markdown(results, 1e-6))
    print(f"wrote {out}/faults.md, faults.json and each class's run directory (mismatch_report.json, .png)")
    return 0 if passed(results) else 1


if __name__ == "__main__":
    sys.exit(main())
