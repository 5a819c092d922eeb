"""`parity` command line: a thin dispatcher.

Every subcommand lives in its own module and is imported only when chosen, so `parity --help`
never imports torch or vllm. Each target is a function `(argv) -> exit code`.

  parity run [flags]                       the whole pipeline on one machine (commands/run/launcher)
  parity run --resume RUN_DIR              continue a killed run from its last checkpoint
  parity runs ls [DIR]                     run directories with status and final metrics
  parity serve rollout|trainer|broadcast   one service as a gRPC server
  parity actor [flags]                     the rollout actor loop (generate, score, publish)
  parity check [flags]                     rollout-vs-trainer logprob parity check
  parity compare RUN_DIR [RUN_DIR ...]     overlay metric curves of runs
  parity models prepare|path MODEL         build/download or locate a model (name, ORG/NAME or DIR)
  parity export RUN_DIR --out DIR          a trainer checkpoint as a Hugging Face model directory
  parity --version                         the installed version

`kill -USR1 PID` of any parity process prints its threads' stacks to its log and changes nothing
else; a crash in native code prints them too. `parity` alone prints this help. Each config-taking
command (run, serve, actor, check) lists its common options with `--help` and every option with
`--help-all`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from parity.stack_dumps import dump_stacks_on_sigusr1

if __name__ == "__mp_main__":
    # A multiprocessing child of a parity command (vLLM's engine core and its workers, spawned by
    # `parity serve rollout`) imports this module as its main: it dies with its parent, so a
    # service killed by any means leaves no engine behind (parity.procs.die_with_parent).
    from parity.procs import die_with_parent

    die_with_parent()

HELP_FLAGS = frozenset({"-h", "--help", "--help-all", "--help_all"})

# Each command imports its module only when chosen (`parity --help` imports no torch, no vllm) and
# takes the rest of argv: `(argv) -> exit code`.


def _serve_rollout(argv: list[str]) -> int:
    from services.rollout.server import main as serve_rollout

    return serve_rollout(argv)


def _serve_trainer(argv: list[str]) -> int:
    from services.trainer.server import main as serve_trainer

    return serve_trainer(argv)


def _serve_broadcast(argv: list[str]) -> int:
    from services.broadcast.server import main as serve_broadcast

    return serve_broadcast(argv)


def _run(argv: list[str]) -> int:
    from commands.run.launcher import main as run

    return run(argv)


def _runs(argv: list[str]) -> int:
    from commands.run.records import main as runs

    return runs(argv)


def _actor(argv: list[str]) -> int:
    if HELP_FLAGS & set(argv):  # the rollout service's options, under this command's own name
        from parity.config.cli import help_text

        print(help_text("rollout", "parity actor", full=bool({"--help-all", "--help_all"} & set(argv))))
        return 0
    from services.rollout.server import main_actor

    return main_actor(argv)


def _export(argv: list[str]) -> int:
    from trainer.export import main as export

    return export(argv)


def _check(argv: list[str]) -> int:
    from commands.check.check import main as check

    return check(argv)


def _compare(argv: list[str]) -> int:
    from commands.check.compare import main as compare

    return compare(argv)


Command = Callable[[list[str]], int]

SERVE_TARGETS: dict[str, Command] = {
    "rollout": _serve_rollout,
    "trainer": _serve_trainer,
    "broadcast": _serve_broadcast,
}
COMMAND_TARGETS: dict[str, tuple[Command, str]] = {
    "run": (_run, "Run the whole pipeline on this machine: redis, broadcast, trainer, rollout."),
    "runs": (_runs, "List run directories (`parity runs ls [DIR]`): status, steps, final metrics."),
    "actor": (_actor, "Run the actor loop: pull prompts, generate groups, score, publish to Redis."),
    "export": (
        _export,
        "Write a trainer checkpoint as a Hugging Face directory (safetensors + config + tokenizer).",
    ),
    "check": (_check, "Measure rollout-vs-trainer logprob mismatch; non-zero exit above threshold."),
    "compare": (_compare, "Overlay the metric curves of run directories and print a table."),
}


def _call(command: Command, argv: list[str]) -> int:
    return int(command(argv) or 0)


def _models(args: argparse.Namespace) -> int:
    from parity import models

    try:
        if args.action == "prepare":
            path = models.resolve(args.model, force=args.force)
            print(f"{args.model}: {path} ({models.size_bytes(path) / 1e6:.1f} MB)")
        else:
            print(models.locate(args.model))
    except models.ModelError as exc:
        print(f"parity models: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, models.ModelNotPrepared) else 2
    return 0


def version() -> str:
    """The installed package's version (its metadata), or the source tree's."""
    from importlib import metadata

    try:
        return metadata.version("parity")
    except metadata.PackageNotFoundError:
        from parity import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parity",
        description="Online RL for LLMs with train-inference parity measured and enforced.",
        epilog="`parity COMMAND --help` shows a command's options (`--help-all`: every one). "
        "Start with `parity run --model tiny --steps 2`.",
    )
    parser.add_argument("--version", action="version", version=f"parity {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMAND_TARGETS.items():
        cmd = sub.add_parser(name, help=help_text, add_help=False)
        cmd.add_argument("rest", nargs=argparse.REMAINDER)
    serve = sub.add_parser("serve", help="Start one service as a gRPC server.")
    serve.add_argument("service", choices=sorted(SERVE_TARGETS))
    serve.add_argument("rest", nargs=argparse.REMAINDER, help="service flags (`--help` lists them)")
    models_cmd = sub.add_parser(
        "models",
        help="Prepare or locate a model: tiny, smollm2-135m, a Hugging Face id ORG/NAME, or a directory.",
        description="prepare: build a built-in model, or download ORG/NAME into the Hugging Face cache "
        "(HF_HOME); path: print the directory a run would load, without building or downloading.",
    )
    models_cmd.add_argument("action", choices=["prepare", "path"])
    models_cmd.add_argument(
        "model", metavar="MODEL", help="tiny, smollm2-135m, ORG/NAME, or a model directory (as --model takes)"
    )
    models_cmd.add_argument("--force", action="store_true", help="rebuild or re-download even if present")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    dump_stacks_on_sigusr1()
    if not argv:
        build_parser().print_help()
        return 0
    # `parity run --help` etc. go to the subcommand's own parser.
    if argv and argv[0] in COMMAND_TARGETS:
        return _call(COMMAND_TARGETS[argv[0]][0], argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _call(SERVE_TARGETS[args.service], args.rest)
    if args.command == "models":
        return _models(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
