"""The compiled WSUM64 kernel (parity/weights/wsum_kernel.c) against numpy's path and the definition."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from parity.weights import checksum, wsum_kernel

MASK64 = 2**64 - 1
# The product builds the kernel with `cc` (scripts/setup.sh) and falls back to numpy's path, by design,
# on a host without one. There, the tests of the compiled kernel skip with this reason, while
# test_without_a_compiler_checksums_take_numpys_path_to_the_same_values proves the fallback on every
# host. With a compiler present, a missing library is a failure, never a skip.
needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None,
    reason="no C compiler (`cc`) on this host: the kernel is not built and checksums use numpy's path",
)


def _definition(words: np.ndarray) -> tuple[int, int]:
    values = [int(w) for w in words]
    return sum(values) & MASK64, sum(j * w for j, w in enumerate(values)) & MASK64


@needs_compiler
def test_setup_built_the_kernel_and_checksums_use_it() -> None:
    assert wsum_kernel.LIBRARY.exists(), f"{wsum_kernel.LIBRARY} is missing: scripts/setup.sh builds it"
    assert wsum_kernel.kernel_name() == "c"
    assert checksum.run_sums() is wsum_kernel.run_sums()


@needs_compiler
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


@needs_compiler
def test_kernel_refuses_a_strided_or_wrongly_typed_array() -> None:
    kernel = wsum_kernel.run_sums()
    assert kernel is not None
    with pytest.raises(ValueError, match="C-contiguous uint64"):
        kernel(np.arange(10, dtype=np.uint64)[::2])
    with pytest.raises(ValueError, match="C-contiguous uint64"):
        kernel(np.arange(10, dtype=np.int64))


@needs_compiler
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


@needs_compiler
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
    if shutil.which("cc") is not None:
        assert wsum_kernel.main([]) == 0 and (tmp_path / "k.so").exists()


def test_without_a_compiler_checksums_take_numpys_path_to_the_same_values(monkeypatch) -> None:
    """No library (no compiler at setup): the process loads no kernel, says so (`kernel_name()`), and
    a checksum's sums are the definition's, so a receiver without the kernel verifies the same bytes."""
    # what a process on that host loads: no library file
    monkeypatch.setattr(wsum_kernel, "_loaded", [wsum_kernel.load(Path("/nonexistent/wsum_kernel.so"))])
    assert wsum_kernel.run_sums() is None and wsum_kernel.kernel_name() == "numpy"
    rng = np.random.default_rng(5)
    for count in (0, 1, 7, 1023, 1025, 3 * checksum.CHUNK_WORDS + 5):
        words = rng.integers(0, 2**64, count, dtype=np.uint64)
        assert checksum._sums(words) == _definition(words), count
