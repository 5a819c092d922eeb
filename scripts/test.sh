#!/usr/bin/env bash
# Sets up .venv/ (idempotent) and runs the whole test suite: ruff, import contracts, then pytest.
#   bash scripts/test.sh [extra pytest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Layer contracts (pyproject [tool.importlinter]): core <- services <- tools, tests never imported.
.venv/bin/lint-imports
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: a broken collection must never pass.
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
