"""The compiled one-pass kernel for WSUM64's run sums (parity/weights/wsum_kernel.c), loaded with ctypes.

numpy has no one-pass integer reduction for S = sum w_j and T = sum j * w_j together: its path in
`checksum._sums` reads the words twice (row sums, then column sums from cache). The C kernel reads
each word once, at the speed of a plain sum; bench/weight_sync.py reports both in ms per 100 MB.

Invariants:
- The kernel is a shared library built next to this file by `python -m parity.weights.wsum_kernel`
  (scripts/setup.sh and infra/Dockerfile run it; it needs a C compiler). No Python extension ABI
  is involved: a plain C function called through ctypes, which releases the GIL for the call, so
  the checksum threads in `checksum.checksums` still run in parallel.
- Where the library is missing or cannot load, `run_sums` is None and checksums are taken with
  numpy: the values are identical, only slower; `kernel_name()` says which path a process uses.
- Unsigned 64-bit arithmetic wraps, which is WSUM64's modulus, so both paths agree bit for bit
  (tests/test_wsum_kernel.py).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("wsum_kernel.c")
LIBRARY = Path(__file__).with_name("_wsum_kernel.so")
# Generic x86-64/aarch64 code (no -march=native): an image built on one host runs on others.
COMPILE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-Wall", "-Wextra", "-Werror")

RunSums = Callable[["np.ndarray"], tuple[int, int]]


def build(compiler: str = "cc", source: Path = SOURCE, library: Path = LIBRARY) -> Path:
    """Compile `source` into `library` unless it is already newer than the source. Raises
    CalledProcessError (with the compiler's output) when the compiler fails."""
    if library.exists() and library.stat().st_mtime >= source.stat().st_mtime:
        return library
    partial = library.with_suffix(".so.partial")
    subprocess.run([compiler, *COMPILE_FLAGS, "-o", str(partial), str(source)], check=True)
    partial.replace(library)  # atomic: a process loading it never sees half a file
    return library


def load(library: Path = LIBRARY) -> RunSums | None:
    """`run_sums(words) -> (S, T)` from the compiled `library` for a C-contiguous uint64 array, or
    None (with a warning) when it is missing or does not load."""
    import numpy as np

    try:
        lib = ctypes.CDLL(str(library))
    except OSError as exc:
        log.warning("checksum kernel %s not loaded (%s): checksums use numpy's two passes", library, exc)
        return None
    kernel = lib.parity_wsum_run_sums
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    kernel.restype = None

    def run_sums(words: np.ndarray) -> tuple[int, int]:
        if words.dtype != np.uint64 or not words.flags.c_contiguous:
            raise ValueError(f"words: want a C-contiguous uint64 array, got {words.dtype}")
        out = np.empty(2, dtype=np.uint64)  # one per call: threads call this concurrently
        kernel(words.ctypes.data, words.size, out.ctypes.data)
        return int(out[0]), int(out[1])

    return run_sums


_loaded: list[RunSums | None] = []


def run_sums() -> RunSums | None:
    """This process's kernel (loaded once), or None where numpy's path is used."""
    if not _loaded:
        _loaded.append(load())
    return _loaded[0]


def kernel_name() -> str:
    """ "c" where the compiled kernel is in use, "numpy" otherwise."""
    return "c" if run_sums() is not None else "numpy"


def main(argv: list[str] | None = None) -> int:
    """`python -m parity.weights.wsum_kernel [compiler]`: build the library (a no-op when it is fresh). A
    missing or failing compiler is a warning, not an error: checksums then take numpy's path."""
    args = sys.argv[1:] if argv is None else argv
    compiler = args[0] if args else "cc"
    try:
        library = build(compiler, SOURCE, LIBRARY)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"wsum kernel: not built ({exc}); checksums will use numpy's slower path", file=sys.stderr)
        return 0
    print(f"wsum kernel: {library}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
