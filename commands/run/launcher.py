"""`parity run`: the whole pipeline on one machine, as separate processes talking gRPC on loopback.

Order of events (each waits for the previous one):
  1. load and validate the run config (defaults, --config FILE, PARITY_* env, flags; exit 2 naming
     the key); resolve the model and the task;
  2. start redis-server (unless --redis_url), the broadcast service, then N rollout services (each
     with its in-process actor), and wait until all report SERVING;
     Every child reads the same effective config, RUN_DIR/config.toml (PARITY_CONFIG), plus its own
     instance values (worker id and index) and the run's auth token in its environment; no child's
     argv is assembled here, and no secret is on any command line;
  3. record every rollout service's parity settings (GetStatus) in config.json; run the preflight
     mismatch gate (commands.check.check.run_check) unless --skip_preflight;
  4. evaluate greedily on held-out prompts at version 0. The trainer is not started yet, so no weight
     update can land mid-evaluation (eval.json records the versions that answered);
  5. start the trainer; follow its metrics.jsonl, printing progress, until it exits 0 after --steps;
  6. wait until every rollout service serves the final version, evaluate again, then write eval.json,
     the plots, summary.md and run_summary.json, and stop everything.
A child that dies early aborts the run naming the child, its exit code and its log tail (exit 1).
Ctrl-C or SIGTERM stops every process group and exits 130. Nothing is left running in any case.

`parity run --resume RUN_DIR` continues a killed run (commands/run/resume.py): the same config, the
private Redis restarted on its append-only file, no preflight and no second "before" evaluation,
and the trainer started before the rollout services (step 5 before 2's rollouts) so that they catch
up to the checkpoint's weights before generating. RUN_DIR/run.json records every launch and how it
ended (commands/run/records.py); the chosen trackers get every step (commands/run/trackers.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from commands.run import records
from commands.run.console import log
from commands.run.cpu_binding import engine_bind_env
from commands.run.held_out import PeriodicEval, run_eval
from commands.run.resume import ResumeError, ResumePlan, format_diff, no_config, truncate_lineage
from commands.run.resume import plan as plan_resume
from commands.run.supervisor import (
    MARKER_ENV,
    ChildDied,
    MetricsFollower,
    Supervisor,
    describe_exit,
    format_duration,
    progress_line,
)
from commands.run.trackers import RunTrackers, TrackerError
from parity.config import ConfigError, LoadedConfig, ParityConfig, env_for, load, write_config
from parity.config.entry import entrypoint
from parity.config.loader import CONFIG_FILE_ENV, config_env_keys
from parity.url_secrets import redact_url

TRAINER = "trainer"
BROADCAST = "broadcast"
EVAL_BEFORE = "eval_before.json"  # the evaluation at version 0, kept for resumed launches


class RunError(RuntimeError):
    """The run cannot continue; the message says why."""


class RunConfigError(ValueError):
    """A config value that only the launcher can judge (the task, the model); names the key."""


def child_config(
    cfg: ParityConfig, run_dir: Path, redis_url: str, broadcast_address: str, stream: str
) -> ParityConfig:
    """The effective config every child reads: the run's, with this run's addresses filled in."""
    return cfg.model_copy(
        update={
            # The resume flags steer this launch only; config.toml never carries them.
            "run": cfg.run.model_copy(
                update={"redis_url": redis_url, "stream": stream, "resume": "", "resume_override": False}
            ),
            "rollout": cfg.rollout.model_copy(update={"broadcast_address": broadcast_address, "actor": True}),
            "trainer": cfg.trainer.model_copy(
                update={"broadcast_address": broadcast_address, "run_dir": str(run_dir)}
            ),
        }
    )


def validate_inputs(cfg: ParityConfig) -> object:
    """Check the fixed ports, resolve the task, then the model (preparing it if needed), before any
    process starts."""
    fixed_ports(cfg)
    from rollout.environments.base import EnvironmentFailed
    from rollout.rewards import build_scorer
    from rollout.tasks import get_task
    from rollout.tasks.chat import check_prompt_format
    from rollout.tasks.stream import PromptStream

    # Everything a rollout worker will build from the task section, built once here, so that a bad
    # file, reward or fleet size fails before any process starts (naming the key, file and line).
    try:
        task = get_task(cfg.task.name, seed=cfg.run.seed, config=cfg.task)
        build_scorer(task, cfg.task)
        for index in range(cfg.run.rollout_workers):
            PromptStream(task, seed=cfg.run.seed, worker_index=index, num_workers=cfg.run.rollout_workers)
        finite = list(getattr(task, "train_set", list)())
        held_out = task.eval_prompts(cfg.task.eval_size) if cfg.task.eval_size else []
        check_prompt_format(finite + held_out, cfg.task.chat_template)
    except EnvironmentFailed as exc:  # env:grpc: the service is not there, or refused this run
        raise RunConfigError(f"task.name: {cfg.task.name}: {exc.message}") from None
    except ValueError as exc:
        message = str(exc)
        if message.startswith("task: "):
            message = "task.name: " + message.removeprefix("task: ")
        elif not message.startswith(("task.", "rollout.", "run.")):
            message = f"task.name: {message}"  # a file error: "PATH:LINE: why"
        raise RunConfigError(message) from None
    from parity import models

    if cfg.model.name in models.MODEL_NAMES:
        try:
            models.locate(cfg.model.name)
        except models.ModelNotPrepared:  # the first use: say why the console is quiet for a while
            log(f"preparing {cfg.model.name} (first use, built on this machine; no download)")
    try:
        models.resolve(cfg.model.name)
    except models.ModelError as exc:
        raise RunConfigError(str(exc)) from None  # "model.name: why"
    note = held_out_shortfall(cfg.task.eval_size, len(held_out))
    if note:
        log(note)
    return task


def waiting_for(done_steps: int, steps: int) -> str:
    """What a progress line says the run waits for, given the steps already in metrics.jsonl."""
    if done_steps >= steps:
        return "the trainer to finish (its last checkpoint and publish)"
    return "first step" if done_steps == 0 else f"step {done_steps + 1}"


def make_run_dir(path: Path, exist_ok: bool) -> None:
    """Create the run directory `path`; one it cannot be is a RunConfigError naming run.out (an
    existing one, unless `exist_ok`, raises FileExistsError)."""
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
        if not os.access(path, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as exc:
        if isinstance(exc, FileExistsError) and not exist_ok:
            raise
        raise RunConfigError(f"run.out: {path}: cannot write a run there ({exc.strerror or exc})") from None


def claim_run_dir(cfg: ParityConfig) -> Path:
    """`run.out`, or a new runs/<UTC time> directory claimed by creating it (a -2, -3, ... suffix
    when another launch took that second's name: two launches never share a directory)."""
    if cfg.run.out:
        return cfg.run.run_dir()
    base = cfg.run.run_dir()
    for index in range(1, 1000):
        candidate = base if index == 1 else base.with_name(f"{base.name}-{index}")
        try:
            make_run_dir(candidate, exist_ok=False)
            return candidate
        except FileExistsError:
            continue
    raise RunConfigError(f"run.out: every name under {base.parent} for this second is taken; give --out")


def fixed_ports(cfg: ParityConfig) -> None:
    """`parity run` starts every service on this host: a port given for them must be one port each
    (a rollout port is taken by every rollout service: with several it would be refused at start)."""
    workers = cfg.run.rollout_workers
    owners: dict[int, str] = {}
    for key, port in [
        ("broadcast.port", cfg.broadcast.port),
        ("broadcast.metrics_port", cfg.broadcast.metrics_port),
        ("broadcast.store_port", cfg.broadcast.store_port),
        ("trainer.port", cfg.trainer.port),
        ("trainer.metrics_port", cfg.trainer.metrics_port),
        ("rollout.port", cfg.rollout.port),
        ("rollout.metrics_port", cfg.rollout.metrics_port),
        ("rollout.openai_port", cfg.rollout.openai_port),
    ]:
        if port <= 0:
            continue
        if key.startswith("rollout.") and workers > 1:
            raise RunConfigError(
                f"{key}: {port} would be taken by each of run.rollout_workers={workers} rollout services; "
                "leave it 0 (a free port each)"
            )
        if port in owners:
            raise RunConfigError(f"{key}: {port} is also {owners[port]}; give each service its own port")
        owners[port] = key


def held_out_shortfall(wanted: int, held: int) -> str | None:
    """A line for the console when the task's held-out set (`held` prompts) is smaller than
    `task.eval_size` (`wanted`: a small data set, a small built-in environment), which the
    evaluation would otherwise only show as a count; None when it is not."""
    if not wanted or held >= wanted:
        return None
    fix = (
        "nothing to evaluate; give a held-out file with --eval_task, or raise --task.eval_fraction"
        if held == 0
        else "accuracy is over those"
    )
    return f"held-out set: {held} prompts, fewer than task.eval_size {wanted} ({fix})"


# --- gRPC helpers ---------------------------------------------------------------------------------
def rollout_status(address: str) -> dict:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from parity.v1 import rollout_pb2, rollout_pb2_grpc

    with grpc.insecure_channel(address) as chan:
        reply = rollout_pb2_grpc.RolloutServiceStub(chan).GetStatus(
            rollout_pb2.RolloutServiceGetStatusRequest(), timeout=10.0
        )
    return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def broadcast_latest_version(address: str) -> int:
    import grpc

    from parity.v1 import broadcast_pb2, broadcast_pb2_grpc

    with grpc.insecure_channel(address) as chan:
        reply = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan).GetStatus(
            broadcast_pb2.WeightBroadcastServiceGetStatusRequest(), timeout=10.0
        )
    return int(reply.latest_version)


def wait_rollouts_at(sup: Supervisor, names: list[str], version: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for name in names:
        while int(rollout_status(sup.children[name].address).get("weight_version", 0)) < version:
            sup.check()
            if time.monotonic() > deadline:
                raise RunError(f"{name} did not reach weight version {version} in {timeout_s:.0f}s")
            time.sleep(0.5)


# --- stages ---------------------------------------------------------------------------------------
def preflight(cfg: ParityConfig, rollout_address: str, run_dir: Path) -> dict:
    """The mismatch gate. Returns what config.json records about it."""
    if cfg.run.skip_preflight:
        log("preflight check SKIPPED (run.skip_preflight)")
        return {"ran": False, "reason": "run.skip_preflight"}
    try:
        from commands.check.check import run_check
    except ImportError as exc:
        raise RunError(
            f"preflight check unavailable ({exc}); pass --run.skip_preflight to train without it"
        ) from exc
    log("preflight: measuring rollout-vs-trainer logprob mismatch (commands.check.check)")
    # The check samples like training does (the task's sampling), from the running rollout service.
    task = cfg.task
    check = cfg.check.model_copy(
        update={
            "rollout_address": rollout_address,
            "temperature": task.temperature,
            "top_p": task.top_p,
            "top_k": task.top_k,
            "max_tokens": task.max_tokens,
            "out": str(run_dir / "preflight"),
        }
    )
    report = run_check(cfg.model_copy(update={"check": check}))
    print(report.table, flush=True)
    if not report.passed:
        if not cfg.run.i_know_the_mismatch_is_high:
            raise RunError(
                "preflight check FAILED: rollout and trainer logprobs disagree (table above, "
                f"{run_dir / 'preflight'}). Fix the engine settings, or pass "
                "--run.i_know_the_mismatch_is_high to train anyway."
            )
        log("WARNING: preflight check FAILED and run.i_know_the_mismatch_is_high is set: training anyway")
    return {"ran": True, "passed": report.passed, "report": report.as_dict()}


def follow_training(
    cfg: ParityConfig,
    sup: Supervisor,
    metrics: MetricsFollower,
    rollouts: list[str],
    trackers: RunTrackers | None = None,
    on_step: Callable[[int], None] | None = None,
) -> dict:
    """Print progress until the trainer exits 0; return timing marks. `metrics` may already hold
    the rows of a resumed run's lineage: only this launch's steps count for the rate and ETA."""
    trainer = sup.children[TRAINER]
    sup.expect_exit.add(TRAINER)
    resumed_at = len(metrics.rows)
    started = time.monotonic()
    first_step_at = last_step_at = None
    last_line_at = started
    gen_tokens_prev, gen_at_prev = None, started
    while True:
        new_rows = metrics.poll()
        for row in new_rows:
            now = time.monotonic()
            first_step_at = first_step_at or now
            last_step_at = now
            gen = _generated_tokens(sup, rollouts)
            gen_rate = ""
            if gen is not None and gen_tokens_prev is not None and now > gen_at_prev:
                gen_rate = f" gen tok/s {(gen - gen_tokens_prev) / (now - gen_at_prev):.0f}"
            gen_tokens_prev, gen_at_prev = gen, now
            line = progress_line(
                row, len(metrics.rows), cfg.run.steps, started, first_step_at, now, resumed_at=resumed_at
            )
            log(line + gen_rate)
            last_line_at = now
            if on_step is not None:
                on_step(int(row.get("step", len(metrics.rows))))
        if trackers:
            trackers.steps(new_rows)
        if trainer.proc.poll() is not None:
            last_rows = metrics.poll()
            if trackers:
                trackers.steps(last_rows)
            if trainer.proc.returncode != 0:
                raise ChildDied(TRAINER, trainer.proc.returncode, trainer.log_tail(20))
            if len(metrics.rows) < cfg.run.steps:
                raise RunError(
                    f"trainer exited 0 after {len(metrics.rows)} of {cfg.run.steps} steps "
                    f"(see {trainer.log_path})"
                )
            break
        sup.check()
        now = time.monotonic()
        since_step = now - (last_step_at or started)
        if since_step > cfg.run.step_timeout_s:
            raise RunError(f"no optimizer step for {since_step:.0f}s (run.step_timeout_s); see logs")
        if now - last_line_at >= cfg.run.progress_interval_s:
            log(
                f"waiting for {waiting_for(len(metrics.rows), cfg.run.steps)} ({format_duration(since_step)} so far)"
            )
            last_line_at = now
        time.sleep(0.5)
    return {
        "trainer_ready_to_first_step_s": (first_step_at or started) - started,
        "trainer_ready_to_last_step_s": (last_step_at or started) - started,
        "trainer_ready_to_exit_s": time.monotonic() - started,
    }


def _generated_tokens(sup: Supervisor, rollouts: list[str]) -> int | None:
    try:
        return sum(
            int(rollout_status(sup.children[n].address).get("generated_tokens_total", 0)) for n in rollouts
        )
    except Exception:  # progress is best effort; a failing child is reported by sup.check()
        return None


def run_pipeline(cfg: ParityConfig, run_dir: Path, argv: list[str], resume: ResumePlan | None = None) -> int:
    """One launch of the run in `run_dir`: a new run, or (`resume`) the continuation of one."""
    run_started = time.monotonic()
    task = validate_inputs(cfg)
    make_run_dir(run_dir, exist_ok=True)
    if resume is None and (run_dir / "metrics.jsonl").exists():
        raise RunConfigError(
            f"run.out: {run_dir} already holds a run (metrics.jsonl); choose another directory, "
            f"or continue it with --resume {run_dir}"
        )
    marker = os.environ.get(MARKER_ENV) or uuid.uuid4().hex  # a caller (a test) may choose it
    token = secrets.token_hex(16)
    # One stream per run, so that runs sharing a run.redis_url never read each other's rollouts; a
    # resumed run continues its own.
    stream = resume.stream if resume else f"{cfg.run.stream}:{marker[:16]}"
    config_path = run_dir / "config.toml"
    record: dict = dict(resume.record) if resume else {}
    record.update(
        {
            "argv": [redact_url(a) for a in argv],
            "run_dir": str(run_dir),
            "marker": marker,
            "stream": stream,
            "config_file": str(config_path),
        }
    )
    records.start(
        run_dir,
        cfg.run.steps,
        record["argv"],
        resumed_from_step=resume.step if resume else None,
        overrides=resume.overrides if resume else {},
    )
    run, model = cfg.run, cfg.model.name
    if resume:
        record.setdefault("resumes", []).append(
            {"from_step": resume.step, "overrides": {k: list(v) for k, v in resume.overrides.items()}}
        )
        truncate_lineage(run_dir, resume.step)  # before anything reads them; the trainer does it too
        log(
            f"resuming {run_dir} from step {resume.step} of {run.steps}"
            + (
                f" (checkpoint {resume.checkpoint.path.name}, version {resume.checkpoint.weight_version})"
                if resume.checkpoint
                else " (no checkpoint: from the start)"
            )
            + (f"; overrides: {format_diff(resume.overrides)}" if resume.overrides else "")
        )
    else:
        log(
            f"run directory {run_dir}  (mode {run.mode}, model {model}, task {cfg.task.name}, {run.steps} steps)"
        )
    # A resumed run's lineage (already cut to the checkpoint), read before any child can append.
    metrics = MetricsFollower(run_dir / "metrics.jsonl")
    lineage = metrics.poll()
    launch_index = len((records.read(run_dir) or {}).get("launches", [])) or 1
    timings: dict[str, float] = {}
    trackers = RunTrackers.open(cfg.run.trackers(), run_dir, launch_index, _public_config(cfg))
    finished = False
    try:
        with Supervisor(run_dir / "logs", marker) as sup:
            redis_url = run.redis_url
            if not redis_url:
                password = resume.redis_password if resume else None
                redis_url = sup.start_redis(password=password)
                log(
                    f"redis-server {'restarted on its append-only file' if resume else 'started'} at "
                    f"{redact_url(redis_url)} (password required, append-only file)"
                )
            # The broadcast service reads its section before its address exists; the others read the
            # file again once it names that address.
            write_config(child_config(cfg, run_dir, redis_url, "", stream), config_path)
            sup.start(
                BROADCAST,
                BROADCAST,
                _child_env(config_path, redis_url, env_for("broadcast", auth_token=token)),
            )
            sup.wait_ready([BROADCAST], run.startup_timeout_s)
            broadcast_address = sup.children[BROADCAST].address
            log(f"broadcast service SERVING at {broadcast_address}")
            child_cfg = child_config(cfg, run_dir, redis_url, broadcast_address, stream)
            write_config(child_cfg, config_path)
            if resume:
                # The trainer first: it restores the checkpoint and re-publishes its weights, so the
                # rollout services catch up to them before their actors generate anything.
                _start_trainer(
                    sup, config_path, redis_url, token, run, gate_env(cfg, record.get("preflight"))
                )
            rollouts = [f"rollout{i}" for i in range(run.rollout_workers)]
            binds = engine_bind_env(len(rollouts)) if cfg.rollout.engine == "vllm" else [{} for _ in rollouts]
            for index, name in enumerate(rollouts):
                instance = env_for("rollout", worker_id=name, worker_index=index, auth_token=token)
                sup.start("rollout", name, {**_child_env(config_path, redis_url, instance), **binds[index]})
            log(
                f"starting {len(rollouts)} rollout service(s) ({cfg.rollout.engine}, {model}); engine start takes a while"
            )
            sup.wait_ready(rollouts, run.startup_timeout_s)
            timings["startup_s"] = time.monotonic() - run_started
            record["config"] = _public_config(child_cfg)
            record["config"]["run"]["redis_url"] = redact_url(redis_url)
            record["broadcast"] = {"address": broadcast_address}
            record["rollout_services"] = {
                n: {"address": sup.children[n].address, **rollout_status(sup.children[n].address)}
                for n in rollouts
            }
            log(f"rollout services SERVING: {', '.join(sup.children[n].address for n in rollouts)}")
            _write_json(run_dir / "config.json", record)
            evals = []
            if resume:
                log(f"preflight: recorded by the first launch ({_preflight_word(record.get('preflight'))})")
                if (run_dir / EVAL_BEFORE).exists():
                    evals.append(json.loads((run_dir / EVAL_BEFORE).read_text()))
            else:
                record["preflight"] = preflight(child_cfg, sup.children[rollouts[0]].address, run_dir)
                _write_json(run_dir / "config.json", record)
                if cfg.task.eval_size:
                    evals.append(run_eval(cfg, task, sup.children[rollouts[0]].address, "before", step=0))
                    _write_json(run_dir / EVAL_BEFORE, evals[0])
                _start_trainer(
                    sup, config_path, redis_url, token, run, gate_env(cfg, record.get("preflight"))
                )
            for result in evals:
                trackers.evaluation(result)
            trackers.steps(lineage)  # a resumed run's steps, replayed into this launch's tracker runs
            log(
                f"trainer SERVING at {sup.children[TRAINER].address}; training to step {run.steps} ({run.mode})"
            )
            periodic = PeriodicEval(cfg, task, sup.children[rollouts[0]].address, evals)
            timings.update(follow_training(cfg, sup, metrics, rollouts, trackers, on_step=periodic))
            log(
                f"trainer finished {len(metrics.rows)} steps ({describe_exit(sup.children[TRAINER].proc.returncode)})"
            )

            final_version = broadcast_latest_version(broadcast_address)
            wait_rollouts_at(sup, rollouts, final_version, timeout_s=cfg.run.step_timeout_s)
            record["final_rollout_status"] = {n: rollout_status(sup.children[n].address) for n in rollouts}
            record["final_weight_version"] = final_version
            if cfg.task.eval_size:
                evals.append(
                    run_eval(cfg, task, sup.children[rollouts[0]].address, "after", step=len(metrics.rows))
                )
                trackers.evaluation(evals[-1])
            ended = sup.stop_all()
            how = ", ".join(f"{n} {why} ({sup.stop_seconds.get(n, 0):.1f}s)" for n, why in ended.items())
            log(f"stopped: {how}")
        finished = True
    finally:
        trackers.close(finished)
    timings["wall_s"] = time.monotonic() - run_started
    _write_json(run_dir / "config.json", record)
    from commands.run.plots import write_results

    write_results(cfg, run_dir, metrics.rows, evals, timings, [redact_url(a) for a in argv])
    with open(run_dir / "summary.md", "a") as handle:
        handle.write(records.summary_lines(run_dir))
    log(f"done in {format_duration(timings['wall_s'])}; summary: {run_dir / 'summary.md'}")
    by_label = {e["label"]: e["accuracy"] for e in evals}
    before, after = by_label.get("before"), by_label.get("after")
    if before is not None and after is not None:  # None: every held-out reward failed, or no eval
        log(
            f"held-out accuracy {100 * before:.1f}% -> {100 * after:.1f}% ({100 * (after - before):+.1f} points)"
        )
    return 0


def _start_trainer(
    sup: Supervisor, config_path: Path, redis_url: str, token: str, run, gate: dict[str, str] | None = None
) -> None:
    # await_workers: a resumed trainer may train its last steps before the rollout services caught up
    instance = env_for("trainer", auth_token=token, await_workers=run.rollout_workers)
    env = {**_child_env(config_path, redis_url, instance), **(gate or {})}
    sup.start(TRAINER, TRAINER, env)
    sup.may_finish.add(TRAINER)
    log("trainer starting")
    sup.wait_ready([TRAINER], run.startup_timeout_s)


def gate_env(cfg: ParityConfig, preflight_record: dict | None) -> dict[str, str]:
    """The trainer's running-gate threshold when it comes from the preflight (reduced precision and
    check.gate_threshold unset): GATE_MARGIN x the clean k3 the preflight measured. Else nothing."""
    from commands.run.gate import preflight_k3
    from trainer.mismatch_gate import calibrated_threshold, running_threshold

    k3 = preflight_k3(preflight_record)
    value, source = running_threshold(cfg, k3)
    log(f"running mismatch gate: k3 above {value:g} ({source})")
    calibrated = calibrated_threshold(cfg, k3)
    return {} if calibrated is None else env_for("check", gate_threshold=calibrated)


def _preflight_word(preflight_record: dict | None) -> str:
    if not preflight_record or not preflight_record.get("ran"):
        return "skipped"
    return "passed" if preflight_record.get("passed") else "FAILED"


def _public_config(cfg: ParityConfig) -> dict:
    """The config as trackers record it: no secrets, no credentials in URLs."""
    dumped = cfg.model_dump(exclude={s: {"auth_token"} for s in ("rollout", "trainer", "broadcast")})
    for section in dumped.values():  # any URL: the Redis URL, the OTLP endpoint, a task's service
        for key, value in section.items():
            if isinstance(value, str):
                section[key] = redact_url(value)
    return dumped


def _child_env(config_path: Path, redis_url: str, instance: dict[str, str]) -> dict[str, str]:
    # The Redis URL travels in the environment: config files never hold a password.
    return {CONFIG_FILE_ENV: str(config_path), **env_for("run", redis_url=redis_url), **instance}


def _write_json(path: Path, payload: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


# --- entry point ----------------------------------------------------------------------------------
_interrupted = False


def _interrupt_once(signum: int, frame: object) -> None:
    """SIGINT/SIGTERM -> KeyboardInterrupt, once: later ones are ignored, so that none can land in
    the supervisor's exit before it holds signals off (which would cut its stop short and leave the
    children running). `timeout` sends its signal twice: to the launcher, then to its process group."""
    global _interrupted
    if not _interrupted:
        _interrupted = True
        raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    return entrypoint(
        "parity run",
        "run",
        argv,
        lambda cfg: launch(cfg, list(argv)),
        effective=lambda loaded: resumed_config(loaded, list(argv)),
    )


def resumed_config(loaded: LoadedConfig, argv: list[str]) -> LoadedConfig:
    """With --resume RUN_DIR: the config the resumed launch runs with (RUN_DIR/config.toml under this
    command line's variables and flags, as commands/run/resume.py loads it); else `loaded`."""
    if not loaded.config.run.resume:
        return loaded
    config_path = Path(loaded.config.run.resume) / "config.toml"
    if not config_path.exists():
        raise ConfigError(no_config(config_path.parent))
    resumed = load(argv, home="run", environ={**os.environ, CONFIG_FILE_ENV: str(config_path)})
    return dataclasses.replace(resumed, print_config=loaded.print_config)


def launch(cfg: ParityConfig, argv: list[str]) -> int:
    resume = None
    if cfg.run.resume:  # before the environment is cleared: PARITY_* variables apply on top of the file
        try:
            resume = plan_resume(Path(cfg.run.resume).resolve(), list(argv))
        except (ResumeError, ConfigError) as exc:  # ConfigError: its config.toml does not load
            print(f"parity run: error: {exc}", file=sys.stderr)
            return 2
        cfg = resume.config
    # The effective config is in RUN_DIR/config.toml now; config variables left in this process's
    # environment would override that file in every child (environment beats file), so drop them.
    for key in config_env_keys(os.environ):
        del os.environ[key]
    # children (redis) chdir; relative paths would break
    try:
        run_dir = resume.run_dir if resume else claim_run_dir(cfg).resolve()
    except RunConfigError as exc:
        print(f"parity run: error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C reaches only this process (children run in their own sessions). Install the handler
    # explicitly: a launcher started in the background inherits SIGINT ignored.
    global _interrupted
    _interrupted = False
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, _interrupt_once),
        signal.SIGINT: signal.signal(signal.SIGINT, _interrupt_once),
    }
    started = time.monotonic()
    rc, reason = 1, ""
    try:
        rc = run_pipeline(cfg, run_dir, list(argv), resume)
        return rc
    except (RunConfigError, TrackerError) as exc:
        print(f"parity run: error: {exc}", file=sys.stderr)
        rc, reason = 2, str(exc)
        if resume is None and not cfg.run.out:
            with contextlib.suppress(OSError):
                run_dir.rmdir()  # the directory claimed for it, left empty: refused before it began
        return rc
    except KeyboardInterrupt:
        log(f"interrupted after {format_duration(time.monotonic() - started)}; every process was stopped")
        rc, reason = 130, "interrupted"
        return rc
    except (ChildDied, RunError, TimeoutError) as exc:
        print(f"parity run: error: {exc}", file=sys.stderr, flush=True)
        print(f"parity run: logs are in {run_dir / 'logs'}", file=sys.stderr, flush=True)
        print(f"parity run: continue it with `parity run --resume {run_dir}`", file=sys.stderr, flush=True)
        rc, reason = 1, str(exc).splitlines()[0]
        return rc
    finally:
        records.finish(run_dir, rc, reason)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
