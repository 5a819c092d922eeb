"""Real-shape models without downloads (bench/shapes.py) and the trainer bench on them
(bench/trainer_step.py): published config numbers, a loadable and reused model directory, and a
bench that records a side's out-of-memory instead of dying on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import shapes
from bench.trainer_step import SideResults, group_rewards, micro_batch_sizes, run_side, size_summary

ROOT = Path(__file__).resolve().parents[1]

# From each model's published config.json, written out here rather than read from shapes.SHAPES.
PUBLISHED = {
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope": {"rope_type": "default", "rope_theta": 1e6},
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope": {"rope_type": "default", "rope_theta": 1e6},
    },
    "qwen2.5-3b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope": {"rope_type": "default", "rope_theta": 1e6},
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}


@pytest.fixture(scope="module")
def one_layer_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen2.5-0.5b cut to one layer (the embedding, 136M of its 494M parameters, stays whole)."""
    return shapes.write_shape("qwen2.5-0.5b", tmp_path_factory.mktemp("shapes") / "qwen-1layer", num_layers=1)


def test_every_named_shape_is_listed_with_its_published_numbers() -> None:
    assert set(shapes.SHAPES) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shape_config_has_the_published_numbers(name: str) -> None:
    config = shapes.hf_config(name)
    expected = dict(PUBLISHED[name])
    assert config.rope_parameters == expected.pop("rope")
    assert {key: getattr(config, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("qwen2.5-0.5b", 0.490e9, 0.500e9), ("qwen2.5-1.5b", 1.53e9, 1.55e9), ("qwen2.5-3b", 3.08e9, 3.10e9)],
)
def test_parameter_count_matches_the_published_model(name: str, low: float, high: float) -> None:
    assert low <= shapes.parameter_count(shapes.hf_config(name)) <= high


def test_a_written_shape_loads_in_the_trainer_and_resolves_to_itself(one_layer_qwen: Path) -> None:
    from parity import models
    from trainer.policy import load_model

    model = load_model(one_layer_qwen)
    assert model.config.num_hidden_layers == 1 and len(model.model.layers) == 1
    assert model.get_output_embeddings().weight.shape == (151936, 896)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    assert 0.015 < float(model.get_input_embeddings().weight.detach().std()) < 0.025  # initialised, not empty
    assert models.resolve(str(one_layer_qwen)) == one_layer_qwen
    marker = json.loads((one_layer_qwen / shapes.MARKER).read_text())
    assert marker == {
        "shape": "qwen2.5-0.5b",
        "dtype": "bfloat16",
        "num_layers": 1,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def test_writing_the_same_shape_again_reuses_the_directory(
    one_layer_qwen: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = one_layer_qwen / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert shapes.write_shape("qwen2.5-0.5b", one_layer_qwen, num_layers=1) == one_layer_qwen
    assert weights.stat().st_mtime_ns == before
    assert "reusing qwen2.5-0.5b" in capsys.readouterr().out


def test_a_directory_holding_something_else_is_an_error_naming_it(
    one_layer_qwen: Path, tmp_path: Path
) -> None:
    with pytest.raises(shapes.ShapeError, match=str(one_layer_qwen)):
        shapes.write_shape("qwen2.5-0.5b", one_layer_qwen, num_layers=2)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(shapes.ShapeError, match=f"{tmp_path}.*no {shapes.MARKER}"):
        shapes.write_shape("qwen2.5-0.5b", tmp_path, num_layers=1)


def test_the_vocabulary_can_be_overridden_and_a_bad_one_is_an_error_naming_the_flag() -> None:
    config = shapes.hf_config("qwen2.5-0.5b", num_layers=1, vocab_size=4096)
    assert (config.vocab_size, config.num_hidden_layers, config.hidden_size) == (4096, 1, 896)
    assert shapes.default_dir("qwen2.5-0.5b", 1, 4096).name == "qwen2.5-0.5b-1layers-vocab4096"
    with pytest.raises(shapes.ShapeError, match="--vocab_size must be at least 2"):
        shapes.hf_config("qwen2.5-0.5b", vocab_size=1)


def test_an_unknown_shape_is_an_error_listing_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        shapes.main(["--shape", "qwen9-1t", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "unknown shape 'qwen9-1t'" in error
    assert all(name in error for name in shapes.SHAPES)
    assert not (tmp_path / "out").exists()


def _optimizer_with_a_gradient():
    import torch

    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    return torch.optim.SGD([weight], lr=0.1), weight


@pytest.mark.parametrize(
    "make_error",
    [
        lambda torch: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        lambda torch: RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: out of memory"),
    ],
    ids=["OutOfMemoryError", "RuntimeError-out-of-memory"],
)
def test_a_side_out_of_memory_is_recorded_not_raised(make_error) -> None:
    import torch

    optimizer, weight = _optimizer_with_a_gradient()
    cleaned: list[bool] = []

    def step() -> None:
        raise make_error(torch)

    result = run_side(step, torch.device("cpu"), optimizer, after_oom=lambda: cleaned.append(True))
    assert result.status == "oom" and result.wall_s is None
    assert cleaned == [True]
    assert weight.grad is None  # gradients freed


def test_a_side_error_that_is_not_out_of_memory_propagates() -> None:
    import torch

    optimizer, weight = _optimizer_with_a_gradient()

    def step() -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x8)")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        run_side(step, torch.device("cpu"), optimizer)
    assert weight.grad is not None


def test_a_side_that_runs_is_timed_without_a_cpu_peak_memory() -> None:
    import torch

    optimizer, _ = _optimizer_with_a_gradient()
    result = run_side(lambda: optimizer.step(), torch.device("cpu"), optimizer)
    assert result.status == "ok" and result.wall_s is not None and result.wall_s > 0
    assert result.peak_memory_gib is None


def test_a_size_with_an_out_of_memory_side_has_no_ratio() -> None:
    import torch

    sides = {"ours": SideResults(wall_s=[2.0, 1.0, 4.0], cpu_s=[2.0, 1.0, 4.0]), "plain": SideResults("oom")}
    entry = size_summary(8, sides, 100, 1e12, torch.device("cpu"), "bf16")
    assert entry["ours_tokens_per_s"] == 50.0 and entry["ours_status"] == "ok"
    assert entry["plain_tokens_per_s"] is None and entry["plain_status"] == "oom"
    assert entry["ratio"] is None
    assert entry["ours_mfu"] is None and entry["ours_peak_memory_gib"] is None  # CPU: no peak known


def test_micro_batch_size_takes_a_comma_list() -> None:
    import argparse

    assert micro_batch_sizes("8") == [8]
    assert micro_batch_sizes("4,8,16") == [4, 8, 16]
    for bad in ("0", "4,x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            micro_batch_sizes(bad)


def test_every_bench_group_has_rewards_that_differ() -> None:
    # A group whose rewards are all equal skips ours' backward but not plain's: it would flatter ours.
    for group_size in (2, 3, 4, 8, 16):
        for group in range(12):
            assert len(set(group_rewards(group, group_size))) > 1, (group, group_size)
    # The groups of four that the published CPU figures used are unchanged.
    assert [group_rewards(g, 4) for g in range(3)] == [
        [1.0, 1.0, 0.0, 1.0],
        [0.0, 1.0, 0.0, 0.0],
        [1.0, 0.0, 0.0, 1.0],
    ]


def test_the_trainer_bench_refuses_a_group_of_one(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.trainer_step import main

    with pytest.raises(SystemExit):
        main(["--group_size", "1"])
    assert "--group_size must be at least 2" in capsys.readouterr().err


@pytest.mark.slow  # a redis-server and a bench process
def test_trainer_bench_runs_a_named_shape_at_two_micro_batch_sizes(tmp_path: Path) -> None:
    # One layer and a 4,096-token vocabulary: with the shape's whole 151,936-token embedding each of
    # the bench's eight steps took 5-9 s on 2 cores (AdamW over 136M parameters), 77-144 s in all.
    small = tmp_path / "qwen-small"
    command = [
        sys.executable,
        str(ROOT / "bench" / "trainer_step.py"),
        *("--shape", "qwen2.5-0.5b", "--num_layers", "1", "--vocab_size", "4096"),
        *("--shape_dir", str(small)),
        *("--micro_batch_size", "2,4", "--groups", "1", "--group_size", "4", "--prompt_len", "8"),
        *("--completion_len", "8", "--repeats", "1", "--threads", "2", "--device", "cpu"),
        *("--profile", str(tmp_path / "profile")),
    ]
    proc = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("mb 2 round 1/1:") for line in lines) and any(
        line.startswith("mb 4 round 1/1:") for line in lines
    )
    summary = json.loads(lines[-1])
    assert summary["shape"] == "qwen2.5-0.5b" and summary["num_layers"] == 1
    assert summary["vocab_size"] == 4096
    assert [entry["micro_batch_size"] for entry in summary["per_micro_batch"]] == [2, 4]
    for entry in summary["per_micro_batch"]:
        assert entry["ours_status"] == entry["plain_status"] == "ok"
        assert entry["ours_tokens_per_s"] > 0 and entry["plain_tokens_per_s"] > 0
        assert entry["ratio"] == pytest.approx(
            entry["ours_tokens_per_s"] / entry["plain_tokens_per_s"], rel=0.1
        )
        assert entry["ours_peak_memory_gib"] is None and entry["plain_peak_memory_gib"] is None
    # The single-size keys describe the first size.
    first = summary["per_micro_batch"][0]
    assert summary["ours_tokens_per_s"] == first["ours_tokens_per_s"]
    assert summary["overhead_ratio"] > 0 and summary["overhead_ratio_cpu"] > 0
    assert f"wrote qwen2.5-0.5b to {small}" in proc.stdout
    # --profile: one more step of each side under torch.profiler, ours split by trainer stage.
    profile = summary["profile"]
    assert set(profile) == {"ours", "plain"}
    assert {"prepare", "forward_backward", "optimizer_step", "step_metrics"} <= set(
        profile["ours"]["stages_ms"]
    )
    assert profile["plain"]["stages_ms"] == {}
    for side in ("ours", "plain"):
        assert profile[side]["clock"] == "cpu" and profile[side]["wall_ms"] > 0
        assert any(op["name"] == "aten::mm" and op["self_ms"] > 0 for op in profile[side]["top_ops"])
        assert "aten::mm" in (tmp_path / "profile" / f"{side}_ops.txt").read_text()
        assert profile[side]["flops"] == sum(profile[side]["flops_by_op"].values())
        assert profile[side]["flops_by_op"]["aten::mm"] > 0
    # The same decoder work on both sides, but ours scores the head at the 8 completion positions
    # only and plain at all 16: ours executes fewer FLOPs.
    assert summary["flops_ratio"] == pytest.approx(
        profile["ours"]["flops"] / profile["plain"]["flops"], rel=1e-3
    )
    assert 0.5 < summary["flops_ratio"] < 0.95
