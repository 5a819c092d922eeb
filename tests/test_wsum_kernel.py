"""The compiled WSUM64 kernel (parity/weights/wsum_kernel.c) against numpy's path and the definition."""

from __future__ import annotations

import logging
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from parity.weights import checksum, wsum_kernel

MASK64 = 2**64 - 1


def _definition(words: np.ndarray) -> tuple[int, int]:
    values = [int(w) for w in words]
    return sum(values) & MASK64, sum(j * w for j, w in enumerate(values)) & MASK64


def test_setup_built_the_kernel_and_checksums_use_it() -> None:
    assert wsum_kernel.LIBRARY.exists(), f"{wsum_kernel.LIBRARY} is missing: scripts/setup.sh builds it"
    assert wsum_kernel.kernel_name() == "c"
    assert checksum.run_sums() is wsum_kernel.run_sums()


def test_kernel_equals_numpy_and_the_definition_at_every_tail_length() -> None:
    kernel = wsum_kernel.run_sums()
    assert kernel is not None
    rng = np.random.default_rng(11)
    # every remainder mod the kernel's 8 lanes and numpy's 1024-word rows, words with the top bit set
    for count in [*range(0, 41), 1023, 1024, 1025, 8 * 1024 + 7]:
        words = rng.integers(0, 2**64, count, dtype=np.uint64, endpoint=False)
        expected = _definition(words)
        assert kernel(words) == expected, count
        assert checksum.run_sums_numpy(words) == expected, count
    big = rng.integers(0, 2**64, 3 * checksum.CHUNK_WORDS + 12_345, dtype=np.uint64)
    assert kernel(big) == checksum.run_sums_numpy(big)
    # a run that starts at an address that is not 8-byte aligned (the kernel assumes no alignment)
    raw = rng.integers(0, 256, 8 * 500 + 1, dtype=np.uint8)
    aligned_copy = np.frombuffer(raw[1:].tobytes(), dtype=np.uint64)
    expected = _definition(aligned_copy)
    assert kernel(aligned_copy) == expected
    shifted = np.ndarray(500, dtype=np.uint64, buffer=raw[1:].data)  # the same bytes, one byte off
    assert shifted.ctypes.data % 8 != 0
    assert kernel(shifted) == expected


def test_kernel_refuses_a_strided_or_wrongly_typed_array() -> None:
    kernel = wsum_kernel.run_sums()
    assert kernel is not None
    with pytest.raises(ValueError, match="C-contiguous uint64"):
        kernel(np.arange(10, dtype=np.uint64)[::2])
    with pytest.raises(ValueError, match="C-contiguous uint64"):
        kernel(np.arange(10, dtype=np.int64))


def test_kernel_runs_from_several_threads_at_once_to_the_same_values() -> None:
    kernel = wsum_kernel.run_sums()
    assert kernel is not None
    rng = np.random.default_rng(2)
    runs = [rng.integers(0, 2**64, 300_000 + i, dtype=np.uint64) for i in range(4)]
    expected = [checksum.run_sums_numpy(r) for r in runs]
    got: dict[int, list[tuple[int, int]]] = {}

    def work(i: int) -> None:
        got[i] = [kernel(runs[i]) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(got[i] == [expected[i]] * 20 for i in range(4))


def test_build_compiles_the_source_once_and_a_missing_library_falls_back(tmp_path: Path, caplog) -> None:
    library = tmp_path / "k.so"
    assert wsum_kernel.build(library=library) == library
    built_at = library.stat().st_mtime_ns
    assert (
        wsum_kernel.build(library=library) == library and library.stat().st_mtime_ns == built_at
    )  # fresh: no-op
    fresh = wsum_kernel.load(library)
    assert fresh is not None
    words = np.random.default_rng(4).integers(0, 2**64, 9999, dtype=np.uint64)
    assert fresh(words) == checksum.run_sums_numpy(words)
    with pytest.raises(subprocess.CalledProcessError):
        wsum_kernel.build(compiler="false", library=tmp_path / "other.so")
    with caplog.at_level(logging.WARNING, logger="parity.weights.wsum_kernel"):
        assert wsum_kernel.load(tmp_path / "absent.so") is None
    assert "numpy" in caplog.text


def test_a_missing_compiler_leaves_setup_going_with_a_warning(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(wsum_kernel, "LIBRARY", tmp_path / "k.so")
    assert wsum_kernel.main(["/nonexistent/cc"]) == 0
    assert "not built" in capsys.readouterr().err and not (tmp_path / "k.so").exists()
    assert wsum_kernel.main(["false"]) == 0  # a compiler that fails
    assert "numpy" in capsys.readouterr().err
    assert wsum_kernel.main([]) == 0 and (tmp_path / "k.so").exists()
