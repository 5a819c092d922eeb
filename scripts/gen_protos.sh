#!/usr/bin/env bash
# Regenerates the committed Python stubs (parity/v1/*_pb2*.py and .pyi) from protos/.
# Usage: bash scripts/gen_protos.sh [OUT_DIR]   (default: the repo root)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
py=${PYTHON:-$root/.venv/bin/python}
"$py" -m grpc_tools.protoc -I"$root/protos" --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" "$root"/protos/parity/v1/*.proto
