"""What each command's flags mean, and its `--help`: the command-line face of the one config.

A flag names a key as `--section.field VALUE`. A bare `--field` resolves, for the command at hand:
  1. to the command's shorthands (`--model` = `--model.name`, `--task` = `--task.name`; every
     command but `parity check` also has `--max_tokens`, `--temperature`, `--top_p`, `--top_k` for
     the training rollouts' sampling, `task.*`);
  2. to a key of the command's own section (`parity serve trainer --dtype` is `--trainer.dtype`);
  3. to the one section that has a key of that name (`--steps` is `--run.steps`).
A bare flag that names keys in several sections, and none of the above, is an error listing the
full names: a bare flag never silently picks one of them. `--help` prints each command's mapping.

`--help` lists the keys people change most, grouped; `--help-all` every key. Neither lists
secrets (environment only), test-only keys, or, under `parity run`, the keys the launcher sets for
each child (which that command also refuses as flags).
"""

from __future__ import annotations

import difflib
import textwrap
from dataclasses import dataclass, field

from parity.config.base import ConfigError, is_secret
from parity.config.schema import SECTIONS, ParityConfig

SECTION_ORDER = ("run", "task", "model", "rollout", "trainer", "broadcast", "check", "observability")
NAME_SHORTHANDS = {"model": "model.name", "task": "task.name"}
SAMPLING_SHORTHANDS = {name: f"task.{name}" for name in ("max_tokens", "temperature", "top_p", "top_k")}
TEST_ONLY_KEYS = frozenset({"rollout.enable_fault_injection", "rollout.fault"})


@dataclass(frozen=True)
class CommandFlags:
    """How one command reads bare flags, and what its `--help` shows."""

    home: str | None  # the command's own section: its bare keys win
    shorthands: dict[str, str]  # bare name -> section.field
    common: tuple[tuple[str, tuple[str, ...]], ...]  # (group title, keys) shown by --help
    owned: frozenset[str] = field(default_factory=frozenset)  # keys the command sets itself


# `parity run` fills these in for each child (addresses, ids, the run directory, the preflight check's
# sampling); a value given for them would be overwritten, so they are refused as flags.
RUN_OWNED = frozenset(
    {
        "rollout.actor",
        "rollout.broadcast_address",
        "rollout.worker_id",
        "rollout.worker_index",
        "rollout.port_file",
        "trainer.broadcast_address",
        "trainer.await_workers",
        "trainer.after_last_step",
        "rollout.max_groups",
        "trainer.run_dir",
        "trainer.port_file",
        "broadcast.port_file",
        "check.rollout_address",
        "check.out",
        "check.max_tokens",
        "check.temperature",
        "check.top_p",
        "check.top_k",
    }
)
RUN_OWNED_HINT = {
    "trainer.run_dir": "use --out",
    "trainer.await_workers": "the trainer awaits every rollout service: use --rollout_workers",
    "trainer.after_last_step": "the run ends when the trainer exits after its last step",
    "rollout.max_groups": "the actors generate until the run's last step: use --steps",
    "check.max_tokens": "the preflight check samples like training: use --task.max_tokens",
    "check.temperature": "the preflight check samples like training: use --task.temperature",
    "check.top_p": "the preflight check samples like training: use --task.top_p",
    "check.top_k": "the preflight check samples like training: use --task.top_k",
}

_SERVICE_SHORTHANDS = {**NAME_SHORTHANDS, **SAMPLING_SHORTHANDS}
COMMANDS: dict[str | None, CommandFlags] = {
    "run": CommandFlags(
        "run",
        _SERVICE_SHORTHANDS,
        (
            ("Model and task", ("model.name", "task.name", "task.reward")),
            (
                "Schedule",
                (
                    "run.steps",
                    "run.seed",
                    "run.mode",
                    "run.groups_per_step",
                    "task.group_size",
                    "run.max_lag",
                ),
            ),
            ("Sampling and training", ("task.max_tokens", "task.temperature", "trainer.lr")),
            (
                "Precision and devices",
                ("rollout.dtype", "trainer.dtype", "trainer.precision", "run.rollout_workers"),
            ),
            ("Output", ("run.out", "run.resume", "task.eval_size", "run.tracker")),
        ),
        RUN_OWNED,
    ),
    "rollout": CommandFlags(
        "rollout",
        _SERVICE_SHORTHANDS,
        (
            (
                "Model and engine",
                (
                    "model.name",
                    "rollout.engine",
                    "rollout.dtype",
                    "rollout.max_model_len",
                    "rollout.max_num_seqs",
                ),
            ),
            (
                "Service",
                (
                    "rollout.host",
                    "rollout.port",
                    "rollout.metrics_port",
                    "rollout.openai_port",
                    "rollout.broadcast_address",
                    "rollout.worker_id",
                ),
            ),
            (
                "Actor",
                (
                    "rollout.actor",
                    "run.redis_url",
                    "task.name",
                    "task.group_size",
                    "task.max_tokens",
                    "task.temperature",
                    "rollout.concurrency",
                ),
            ),
        ),
    ),
    "trainer": CommandFlags(
        "trainer",
        _SERVICE_SHORTHANDS,
        (
            (
                "Model and devices",
                ("model.name", "trainer.dtype", "trainer.precision", "trainer.device", "trainer.nproc"),
            ),
            (
                "Service",
                (
                    "trainer.host",
                    "trainer.port",
                    "trainer.metrics_port",
                    "trainer.broadcast_address",
                    "trainer.run_dir",
                    "run.redis_url",
                ),
            ),
            (
                "Training",
                (
                    "run.steps",
                    "run.groups_per_step",
                    "trainer.lr",
                    "trainer.objective",
                    "trainer.kl_coef",
                    "trainer.micro_batch_tokens",
                    "trainer.checkpoint_every",
                ),
            ),
        ),
    ),
    "broadcast": CommandFlags(
        "broadcast",
        _SERVICE_SHORTHANDS,
        (
            ("Service", ("broadcast.host", "broadcast.port", "broadcast.metrics_port")),
            (
                "Data plane",
                (
                    "broadcast.backend",
                    "broadcast.data_host",
                    "broadcast.store_port",
                    "broadcast.bucket_bytes",
                    "broadcast.delta_updates",
                ),
            ),
            ("Workers", ("broadcast.heartbeat_timeout_s", "broadcast.transfer_timeout_s")),
            ("Version events", ("broadcast.notify_redis", "run.redis_url", "run.stream")),
        ),
    ),
    "check": CommandFlags(
        "check",
        NAME_SHORTHANDS,
        (
            (
                "Model and prompts",
                ("model.name", "task.name", "check.num_prompts", "check.samples_per_prompt"),
            ),
            ("Sampling", ("check.max_tokens", "check.temperature", "check.top_p", "check.top_k")),
            (
                "Engine under test",
                ("check.rollout_address", "rollout.engine", "rollout.dtype", "rollout.logprobs_mode"),
            ),
            ("Gate and output", ("check.threshold", "check.out", "check.ablate", "check.faults")),
        ),
    ),
    None: CommandFlags(None, NAME_SHORTHANDS, ()),
}


def command_flags(home: str | None) -> CommandFlags:
    return COMMANDS.get(home) or CommandFlags(home, dict(NAME_SHORTHANDS), ())


def _fields(section: str) -> dict:
    return SECTIONS[section].model_fields


def sections_with(name: str) -> list[str]:
    """The sections that have a key called `name`, in SECTION_ORDER."""
    return [s for s in SECTION_ORDER if name in _fields(s)]


def resolve_flag(flag: str, home: str | None) -> tuple[str, str]:
    """(section, field) that `--flag` names under the command whose own section is `home`."""
    name = flag.replace("-", "_")
    if "." in name:
        section, _, field_name = name.partition(".")
        return section, field_name
    spec = command_flags(home)
    if name in spec.shorthands:
        section, _, field_name = spec.shorthands[name].partition(".")
        return section, field_name
    if home and name in _fields(home):
        return home, name
    owners = sections_with(name)
    if len(owners) == 1:
        return owners[0], name
    if owners:
        full = " or ".join(f"--{s}.{name}" for s in owners)
        raise ConfigError(f"--{flag}: ambiguous, it names a key in {len(owners)} sections; use {full}")
    every = [f"{s}.{n}" for s in SECTION_ORDER for n in _fields(s)]
    bare = sorted({n for s in SECTION_ORDER for n in _fields(s)} | set(spec.shorthands))
    close = difflib.get_close_matches(name, bare, n=1) or difflib.get_close_matches(name, every, n=1)
    hint = ""
    if close:
        suggestion = close[0]
        if "." not in suggestion and suggestion not in spec.shorthands and len(sections_with(suggestion)) > 1:
            suggestion = " or --".join(f"{s}.{suggestion}" for s in sections_with(suggestion))
        hint = f"; did you mean --{suggestion}?"
    raise ConfigError(f"--{flag}: unknown option{hint} (`--help` lists them)")


def check_flag_allowed(section: str, name: str, home: str | None) -> None:
    """Refuse a key the command sets itself (`parity run` and the keys of each child)."""
    key = f"{section}.{name}"
    if key in command_flags(home).owned:
        hint = RUN_OWNED_HINT.get(key, "it is set for each child process")
        raise ConfigError(f"{key}: set by `parity run` itself, not a flag of it ({hint})")


def hidden(section: str, name: str, home: str | None) -> bool:
    """Keys no `--help` lists: secrets, test-only keys, keys the command sets itself."""
    key = f"{section}.{name}"
    return is_secret(SECTIONS[section], name) or key in TEST_ONLY_KEYS or key in command_flags(home).owned


def flag_for(key: str, home: str | None) -> str:
    """The shortest flag that names `key` under this command: bare when the bare name resolves to it."""
    section, _, name = key.partition(".")
    for bare, target in command_flags(home).shorthands.items():
        if target == key:
            return f"--{bare}"
    try:
        if resolve_flag(name, home) == (section, name):
            return f"--{name}"
    except ConfigError:
        pass
    return f"--{key}"


def _line(key: str, home: str | None, defaults: ParityConfig) -> str:
    section, _, name = key.partition(".")
    info = _fields(section)[name]
    default = getattr(getattr(defaults, section), name)
    flag = flag_for(key, home)
    label = f"{flag} ({key}, default {default!r})" if flag != f"--{key}" else f"{flag} (default {default!r})"
    return f"  {label}: {info.description}"


def bare_flag_rules(home: str | None) -> list[str]:
    """How bare flags resolve for this command, as --help prints it."""
    spec = command_flags(home)
    shorthands = ", ".join(f"--{bare} = --{key}" for bare, key in spec.shorthands.items())
    lines = ["Bare flags:", *textwrap.wrap(shorthands, 100, initial_indent="  ", subsequent_indent="    ")]
    if home:
        lines.append(f"  any other key of [{home}] by its name: --FIELD = --{home}.FIELD")
    example = "--steps = --run.steps" if home in ("trainer", "check") else "--lr = --trainer.lr"
    lines.append(f"  a key that only one section has: {example}")
    ambiguous = []
    for name in sorted({n for s in SECTION_ORDER for n in _fields(s)}):
        owners = sections_with(name)
        if len(owners) < 2 or name in spec.shorthands or (home and name in _fields(home)):
            continue
        owners = [s for s in owners if not hidden(s, name, home)]
        if len(owners) > 1:
            ambiguous.append(f"    --{name}: " + " or ".join(f"--{s}.{name}" for s in owners))
    if ambiguous:
        lines += ["  a name in several sections is an error; give the section:", *ambiguous]
    return lines


def help_text(home: str | None, prog: str, full: bool = False) -> str:
    """`--help` (the common keys, grouped) or `--help-all` (every key), for the command `prog`."""
    spec = command_flags(home)
    defaults = ParityConfig()
    lines = [
        f"usage: {prog} [--config FILE ...] [--print-config] [--help-all] [--section.field VALUE ...]",
        "",
        "  --config FILE   a TOML config; repeat to layer files (later files win); default $PARITY_CONFIG",
        "  --print-config  print the effective config, with where every value came from, and exit",
        "  --help-all      every option; docs/config.md is the full reference",
        "Precedence, lowest first: defaults, --config files, PARITY_<SECTION>_<FIELD> variables, flags.",
        "Secrets (auth tokens) are read from the environment only.",
        "",
        *bare_flag_rules(home),
    ]
    if not full and spec.common:
        total = sum(1 for s in SECTION_ORDER for n in _fields(s) if not hidden(s, n, home))
        lines += ["", f"Common options ({prog} --help-all lists all {total}):"]
        for title, keys in spec.common:
            lines.append(f"\n{title}")
            lines += [_line(key, home, defaults) for key in keys]
        return "\n".join(lines)
    order = ([home] if home else []) + [s for s in SECTION_ORDER if s != home]
    for section in order:
        lines.append(f"\n[{section}]  (env PARITY_{section.upper()}_<FIELD>)")
        lines += [
            _line(f"{section}.{name}", home, defaults)
            for name in _fields(section)
            if not hidden(section, name, home)
        ]
    return "\n".join(lines)
