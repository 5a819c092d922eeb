"""`parity export RUN_DIR --out DIR`: a trainer checkpoint as a Hugging Face model directory.

The output is what `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and vLLM load:
model.safetensors (+ index when sharded by size), config.json, generation_config.json when the base
model has one, and the base model's tokenizer files. The weights come from the checkpoint's DCP
directory (any number of ranks wrote it; it is read here in one process, unsharded), into the
architecture and tokenizer of the base model the run started from (checkpoint model.json, or
`--model`).

Atomic: written into a temporary sibling of DIR and renamed; an existing DIR is refused unless
`--force`. Runs on CPU; nothing is trained or changed in RUN_DIR.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path


class ExportError(RuntimeError):
    """The export cannot proceed; the message says what is missing."""


def export(
    run_dir: str | Path, out_dir: str | Path, model: str = "", checkpoint: str = "", force: bool = False
) -> Path:
    """Write the checkpoint (newest, or `checkpoint` = a step_* directory) to `out_dir`."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not (run_dir / "checkpoints").is_dir():  # before the heavy imports: a wrong path fails fast
        raise ExportError(f"RUN_DIR: {run_dir} has no checkpoints/ directory")
    from transformers import AutoTokenizer

    from parity import models
    from trainer.checkpoint import CheckpointStore, load_model_weights
    from trainer.policy import load_model

    path = Path(checkpoint) if checkpoint else CheckpointStore(run_dir).latest()
    if path is None or not (path / "state.json").exists():
        raise ExportError(f"RUN_DIR: no complete checkpoint under {run_dir / 'checkpoints'}")
    if not model:
        record = path / "model.json"
        if not record.exists():
            raise ExportError(f"--model: {path} does not record its base model; name it with --model")
        model = json.loads(record.read_text())["model"]
    base = models.resolve(model)
    if out_dir.exists() and not force:
        raise ExportError(f"--out: {out_dir} exists (use --force to replace it)")
    hf_model = load_model(base)
    load_model_weights(hf_model, path)
    hf_model.eval()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        hf_model.config.use_cache = True
        hf_model.save_pretrained(staging, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(base)).save_pretrained(staging)
        state = json.loads((path / "state.json").read_text())
        (staging / "parity_export.json").write_text(
            json.dumps(
                {
                    "checkpoint": str(path),
                    "step": state.get("step"),
                    "weight_version": state.get("weight_version"),
                }
            )
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parity export", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="The trainer's run_dir (holds checkpoints/).")
    parser.add_argument("--out", required=True, help="Directory to write (must not exist unless --force).")
    parser.add_argument("--model", default="", help="Base model (name or HF dir); default: the checkpoint's.")
    parser.add_argument("--checkpoint", default="", help="A step_* directory; default: the newest.")
    parser.add_argument("--force", action="store_true", help="Replace an existing --out directory.")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        out = export(args.run_dir, args.out, args.model, args.checkpoint, args.force)
    except ExportError as exc:
        print(f"parity export: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
