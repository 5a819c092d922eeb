"""`parity export RUN_DIR --out DIR`: transformers loads the directory and gives the trainer's logits.

A trainer takes one real step on the tiny model (so the weights differ from the base), saves a DCP
checkpoint, and the CLI exports it. Logits of `AutoModelForCausalLM.from_pretrained(DIR)` (fp32)
at the completion positions equal the trainer's fp32-head logits within 1e-5 (same weights, same
kernels; measured max |Δ| 0), and differ from the untrained base model's by far more.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import config_for

ROOT = Path(__file__).resolve().parents[1]


def test_export_gives_transformers_the_trainers_logits(tmp_path: Path, tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.fakes.synthetic_rollouts import make_group
    from trainer.checkpoint import CheckpointStore, TrainerState
    from trainer.consumer import Batch
    from trainer.loop import Trainer
    from trainer.policy import load_model, pad_batch
    from trainer.prepare import prepare

    run_dir = tmp_path / "run"
    trainer = Trainer(config_for("trainer", model="tiny", device="cpu", run_dir=str(run_dir), lr=1e-2))
    trainer.setup_model()
    groups = [
        make_group(trainer.model, "g0", (1.0, 0.0, 0.0, 1.0), generator=torch.Generator().manual_seed(0))
    ]
    sequences = prepare(Batch(groups=groups), trainer.config).sequences
    _, result = trainer.update(sequences)
    assert result.stepped
    CheckpointStore(run_dir, model_source=str(tiny_model)).save(
        trainer.model, trainer.optimizer, TrainerState(step=1), trainer.scheduler
    )
    out = tmp_path / "export"
    proc = subprocess.run(
        [sys.executable, "-m", "commands.main", "export", str(run_dir), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # 120 s ran out on a box 2.5x slower than usual
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # One process, no process group: DCP's warning that it assumed so is not shown to the user.
    assert "torch.distributed is disabled" not in proc.stderr, proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr, proc.stderr[-3000:]
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert AutoTokenizer.from_pretrained(str(out)).encode("12+7") == AutoTokenizer.from_pretrained(
        str(tiny_model)
    ).encode("12+7")

    inputs = [s.inputs for s in sequences]
    ids_BL, mask_BL, rows_T, cols_T, _ = pad_batch(inputs)
    with torch.no_grad():
        ours_TV = trainer.scorer(ids_BL, mask_BL, rows_T, cols_T)
        exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        theirs_TV = exported(input_ids=ids_BL, attention_mask=mask_BL).logits[rows_T, cols_T].float()
        base_TV = load_model(tiny_model)(input_ids=ids_BL, attention_mask=mask_BL).logits[rows_T, cols_T]
    diff = float((ours_TV - theirs_TV).abs().max())
    print(
        f"max |Δlogit| exported vs trainer {diff:.2e}; vs base {float((base_TV - ours_TV).abs().max()):.2e}"
    )
    assert diff <= 1e-5
    assert float((base_TV - ours_TV).abs().max()) > 1e-3  # the export carries the trained weights


def test_export_refuses_a_run_without_checkpoints(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "commands.main", "export", str(tmp_path), "--out", str(tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "RUN_DIR" in proc.stderr and "checkpoints" in proc.stderr


@pytest.mark.slow
def test_vllm_serves_the_export_with_the_trainers_logprobs(tmp_path: Path, tiny_model: Path) -> None:
    """vLLM (CPU, fp32, fp32 head) loads the exported directory and samples; the trainer's
    logprobs of those tokens (processed under each transform) agree within the replay test's 2e-4."""
    import json
    import os

    from parity.sampling import SamplingTransform
    from tests.fakes.synthetic_rollouts import make_group
    from trainer.checkpoint import CheckpointStore, TrainerState
    from trainer.consumer import Batch
    from trainer.loop import Trainer
    from trainer.policy import SequenceInput, token_logprobs
    from trainer.prepare import prepare

    run_dir = tmp_path / "run"
    trainer = Trainer(config_for("trainer", model="tiny", device="cpu", run_dir=str(run_dir), lr=1e-2))
    trainer.setup_model()
    group = make_group(trainer.model, "g0", (1.0, 0.0, 0.0, 1.0), generator=torch.Generator().manual_seed(0))
    sequences = prepare(Batch(groups=[group]), trainer.config).sequences
    trainer.update(sequences)
    CheckpointStore(run_dir, model_source=str(tiny_model)).save(
        trainer.model, trainer.optimizer, TrainerState(step=1), trainer.scheduler
    )
    out = tmp_path / "export"
    from trainer.export import export

    export(run_dir, out)
    records_path = tmp_path / "vllm.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "test_trainer_replay.py"), str(out), str(records_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1000,  # a vLLM start and generation: 400 s ran out on a box 2.5x slower than usual
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads(records_path.read_text())
    worst = 0.0
    with torch.no_grad():
        for record in records:
            inputs = SequenceInput(
                tuple(record["prompt_ids"]),
                tuple(record["token_ids"]),
                SamplingTransform(*record["transform"]),
            )
            ours, _ = token_logprobs(trainer.scorer, [inputs])
            worst = max(worst, float((ours - torch.tensor(record["logprobs"])).abs().max()))
    print(f"vLLM on the export vs trainer: max |Δlogprob| {worst:.2e} over {len(records)} completions")
    assert records and worst <= 2e-4
