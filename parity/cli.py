"""`parity` command line: a thin dispatcher.

Every subcommand lives in its own module and is imported only when chosen, so `parity --help`
never imports torch or vllm. Each target is `module:function(argv) -> exit code`.

  parity run [flags]                       the whole pipeline on one machine (tools/run/launcher)
  parity run --resume RUN_DIR              continue a killed run from its last checkpoint
  parity runs ls [DIR]                     run directories with status and final metrics
  parity serve rollout|trainer|broadcast   one service as a gRPC server
  parity actor [flags]                     the rollout actor loop (generate, score, publish)
  parity check [flags]                     rollout-vs-trainer logprob parity check
  parity compare RUN_DIR [RUN_DIR ...]     overlay metric curves of runs
  parity models prepare|path NAME          build or locate a model
  parity export RUN_DIR --out DIR          a trainer checkpoint as a Hugging Face model directory
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

if __name__ == "__mp_main__":
    # A multiprocessing child of a parity command (vLLM's engine core and its workers, spawned by
    # `parity serve rollout`) imports this module as its main: it dies with its parent, so a
    # service killed by any means leaves no engine behind (parity.procs.die_with_parent).
    from parity.procs import die_with_parent

    die_with_parent()

SERVE_TARGETS = {
    "rollout": "rollout.server:main",
    "trainer": "trainer.server:main",
    "broadcast": "services.broadcast.server:main",
}
COMMAND_TARGETS = {
    "run": (
        "tools.run.launcher:main",
        "Run the whole pipeline on this machine: redis, broadcast, trainer, rollout.",
    ),
    "runs": (
        "tools.run.records:main",
        "List run directories (`parity runs ls [DIR]`): status, steps, final metrics.",
    ),
    "actor": (
        "rollout.server:main_actor",
        "Run the actor loop: pull prompts, generate groups, score, publish to Redis.",
    ),
    "export": (
        "trainer.export:main",
        "Write a trainer checkpoint as a Hugging Face directory (safetensors + config + tokenizer).",
    ),
    "check": (
        "tools.check.check:main",
        "Measure rollout-vs-trainer logprob mismatch; non-zero exit above threshold.",
    ),
    "compare": (
        "tools.check.compare:main",
        "Overlay the metric curves of run directories and print a table.",
    ),
}


def _call(target: str, argv: list[str]) -> int:
    module_name, func_name = target.split(":")
    module = importlib.import_module(module_name)
    return int(getattr(module, func_name)(argv) or 0)


def _models(args: argparse.Namespace) -> int:
    from parity import models

    try:
        if args.action == "prepare":
            path = models.prepare(args.name, force=args.force)
            print(f"{args.name}: {path} ({models.size_bytes(path) / 1e6:.1f} MB, verified)")
        else:
            path = models.model_dir(args.name)
            if not models.verify(path):
                print(
                    f"{args.name} is not prepared; run `parity models prepare {args.name}`", file=sys.stderr
                )
                return 1
            print(path)
    except models.ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parity",
        description="Online RL for LLMs with train-inference parity measured and enforced.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMAND_TARGETS.items():
        cmd = sub.add_parser(name, help=help_text, add_help=False)
        cmd.add_argument("rest", nargs=argparse.REMAINDER)
    serve = sub.add_parser("serve", help="Start one service as a gRPC server.")
    serve.add_argument("service", choices=sorted(SERVE_TARGETS))
    serve.add_argument("rest", nargs=argparse.REMAINDER, help="service flags (`--help` lists them)")
    models_cmd = sub.add_parser("models", help="Prepare or locate a model (tiny, smollm2-135m).")
    models_cmd.add_argument("action", choices=["prepare", "path"])
    models_cmd.add_argument("name", help="tiny or smollm2-135m")
    models_cmd.add_argument("--force", action="store_true", help="rebuild even if verified")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
