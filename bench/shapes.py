"""Randomly initialised HF models in the shapes of real ones, written without the network.

    python bench/shapes.py --shape qwen2.5-1.5b --out DIR [--dtype bfloat16|float32] [--num_layers N]
        [--vocab_size V]

A trainer benchmark needs a model's shape (vocabulary, width, depth, heads), not its trained
weights: a step's time and memory do not depend on the weights' values. `SHAPES` holds public
architecture facts of a few models; `write_shape` builds one from its config alone (seeded, the
architecture's own init), so a bench machine needs no Hub access and no download.

Invariants:
- The directory is a plain HF model directory (config.json + safetensors): `trainer.policy.load_model`
  and `parity.models.resolve` take it as it is.
- `parity_shape.json` records what the directory holds (shape, dtype, layers, parameters). Writing is
  idempotent: a directory with the same marker is reused untouched; one with another marker, or with
  files but no marker, is an error naming it. The model is written to a temporary sibling and renamed
  into place, so a crash never leaves a half-written directory behind.
- Same shape, layers, dtype and seed: the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

MARKER = "parity_shape.json"
SEED = 0
Dtype = Literal["bfloat16", "float32"]


class ShapeError(ValueError):
    """An unknown shape, or a directory that holds something else than the shape asked for."""


@dataclass(frozen=True)
class Shape:
    """The architecture of a public model, from its published config.json."""

    family: Literal["qwen2", "llama"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    # Extra rope parameters beyond the default rotary embedding (Llama 3's frequency scaling).
    rope_scaling: tuple[tuple[str, Any], ...] = ()


_QWEN25 = {"vocab_size": 151936, "rope_theta": 1e6, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}

SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape(
        "qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        tie_word_embeddings=True,
        **_QWEN25,
    ),
    "qwen2.5-1.5b": Shape(
        "qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        tie_word_embeddings=True,
        **_QWEN25,
    ),
    "qwen2.5-3b": Shape(
        "qwen2",
        hidden_size=2048,
        intermediate_size=11008,
        num_layers=36,
        num_heads=16,
        num_kv_heads=2,
        tie_word_embeddings=True,
        **_QWEN25,
    ),
    "llama-3.2-1b": Shape(
        "llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_scaling=(
            ("rope_type", "llama3"),
            ("factor", 32.0),
            ("low_freq_factor", 1.0),
            ("high_freq_factor", 4.0),
            ("original_max_position_embeddings", 8192),
        ),
    ),
}


def get_shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ShapeError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return SHAPES[name]


def default_dir(name: str, num_layers: int | None = None, vocab_size: int | None = None) -> Path:
    """$PARITY_HOME/shapes/NAME (PARITY_HOME defaults to ~/.cache/parity); NAME-Nlayers and
    NAME-vocabV when the depth or the vocabulary is overridden."""
    home = Path(os.environ.get("PARITY_HOME", Path.home() / ".cache" / "parity"))
    suffix = (f"-{num_layers}layers" if num_layers is not None else "") + (
        f"-vocab{vocab_size}" if vocab_size is not None else ""
    )
    return home / "shapes" / f"{name}{suffix}"


def hf_config(
    name: str, num_layers: int | None = None, dtype: Dtype = "bfloat16", vocab_size: int | None = None
):
    """The transformers config of shape `name`; `num_layers` overrides the depth and `vocab_size`
    the vocabulary (quick tests: the result is no longer the real shape)."""
    from transformers import LlamaConfig, Qwen2Config

    shape = get_shape(name)
    if num_layers is not None and num_layers < 1:
        raise ShapeError(f"--num_layers must be at least 1 (got {num_layers})")
    if vocab_size is not None and vocab_size < 2:
        raise ShapeError(f"--vocab_size must be at least 2 (got {vocab_size})")
    rope = {"rope_type": "default", "rope_theta": shape.rope_theta, **dict(shape.rope_scaling)}
    config_class = Qwen2Config if shape.family == "qwen2" else LlamaConfig
    return config_class(
        vocab_size=vocab_size or shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=num_layers or shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        tie_word_embeddings=shape.tie_word_embeddings,
        rope_parameters=rope,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        initializer_range=0.02,
        dtype=dtype,
    )


def parameter_count(config) -> int:
    """Parameters of the model `config` describes (tied weights once), counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def marker(name: str, config, dtype: Dtype) -> dict[str, Any]:
    return {
        "shape": name,
        "dtype": dtype,
        "num_layers": config.num_hidden_layers,
        "parameters": parameter_count(config),
    }


def write_shape(
    name: str,
    out: str | Path,
    dtype: Dtype = "bfloat16",
    num_layers: int | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Write shape `name` (randomly initialised) into `out`, or reuse `out` when it already holds it."""
    out = Path(out).expanduser()
    config = hf_config(name, num_layers, dtype, vocab_size)
    wanted = marker(name, config, dtype)
    if out.exists() and any(out.iterdir()):
        marker_path = out / MARKER
        if not marker_path.exists():
            raise ShapeError(f"{out} is not empty and has no {MARKER}: not a shape directory; choose another")
        found = json.loads(marker_path.read_text())
        if found != wanted:
            raise ShapeError(f"{out} holds {found}, not {wanted}; remove it or choose another directory")
        print(f"reusing {name} in {out} ({found['parameters']:,} params)", flush=True)
        return out
    print(
        f"writing {name} ({config.num_hidden_layers} layers, {dtype}, "
        f"{wanted['parameters']:,} params) to {out}",
        flush=True,
    )
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _save_random_model(config, dtype, staging)
        (staging / MARKER).write_text(json.dumps(wanted, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {name} to {out} in {time.perf_counter() - start:.1f} s", flush=True)
    return out


def _save_random_model(config, dtype: Dtype, directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    # Built on the meta device, then initialised once by the architecture's own init (which also
    # fills the rotary buffers): half the time of a CPU build, which initialises every layer twice.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.init_weights()
    model.save_pretrained(directory, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", required=True, help=f"one of: {', '.join(SHAPES)}")
    parser.add_argument("--out", required=True, help="model directory to write (or reuse)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--num_layers",
        type=int,
        default=None,
        help="override the shape's depth (for quick tests; the result is no longer the real shape)",
    )
    parser.add_argument(
        "--vocab_size",
        type=int,
        default=None,
        help="override the shape's vocabulary (for quick tests; the result is no longer the real shape)",
    )
    args = parser.parse_args(argv)
    try:
        write_shape(args.shape, args.out, args.dtype, args.num_layers, args.vocab_size)
    except ShapeError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
