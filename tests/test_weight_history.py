"""The trainer's weight history (trainer/weight_history.py): one host copy per recorded version.

- a recorded version is a copy: the source changing afterwards (the optimizer stepping) leaves it
  as it was; `keep` bounds the versions held, dropping the oldest, never the newest;
- GPU (`gpu` marker): copies of CUDA tensors are pinned host memory, complete when `record`
  returns, equal to the source, and load back onto the GPU unchanged.
"""

from __future__ import annotations

import pytest
import torch

from trainer.weight_history import WeightHistory


def _named(device: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed": (64, 16), "layer.weight": (16, 16), "layer.bias": (16,), "norm": (16,)}
    return [(name, torch.randn(shape, generator=gen).to(device)) for name, shape in shapes.items()]


def test_a_recorded_version_is_a_copy_and_keep_drops_the_oldest() -> None:
    history = WeightHistory(keep=2)
    named = _named("cpu", 0)
    expected = {name: tensor.clone() for name, tensor in named}
    history.record(1, named)
    for _, tensor in named:
        tensor.add_(1.0)  # the optimizer steps right after the publish
    held = history.get(1)
    assert held is not None and held.keys() == expected.keys()
    assert all(torch.equal(held[name], expected[name]) for name in expected)
    history.record(2, _named("cpu", 1))
    history.record(3, _named("cpu", 2))
    assert history.versions() == [2, 3] and 1 not in history
    assert [t.shape for t in history.ordered(3, ["norm", "embed"])] == [(16,), (64, 16)]
    assert history.ordered(1, ["norm"]) is None
    with pytest.raises(ValueError, match="keep"):
        WeightHistory(keep=0)


@pytest.mark.gpu
def test_copies_of_cuda_tensors_are_pinned_and_load_back_unchanged() -> None:
    history = WeightHistory(keep=2)
    named = _named("cuda", 0)
    originals = {name: tensor.clone() for name, tensor in named}
    history.record(1, named)
    held = history.get(1)
    for name, tensor in named:
        assert held[name].device.type == "cpu" and held[name].is_pinned(), name
        assert torch.equal(held[name], tensor.cpu()), name
        tensor.add_(1.0)
    loaded = {name: torch.empty_like(tensor) for name, tensor in named}
    for name, target in loaded.items():
        target.copy_(held[name], non_blocking=True)
    torch.cuda.synchronize()
    assert all(torch.equal(loaded[name], originals[name]) for name in originals)
