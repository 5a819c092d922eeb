#!/usr/bin/env bash
# Every GPU check in one go, on a GPU host (see docs/gpu.md): the gpu-marked tests, then the GPU benches.
#   bash ../shared/gpu/carry-deps.sh          # here, after scripts/setup.sh: builds .gpu/ (wheels + redis-server)
#   source .gpu/env.sh && bash scripts/gpu_check.sh      # there; logs go to $OUT (or runs/gpu-check)
# Each step has its own time limit, so one hang cannot eat the whole lease. The steps run in order of
# what is least known: what has never run on a GPU first, the benches earlier leases measured last, so
# a lease cut short still brings back the new figures (every log is written as it goes).
set -uo pipefail
out=${OUT:-runs/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$SECONDS
stamp() { echo "[gpu_check +$((SECONDS - start))s] $*"; }
{ nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$out/host.log"
# The one-pass checksum kernel is not carried (a build output): build it here, or warn and use numpy.
python3 -m parity.weights.wsum_kernel 2>&1 | tee "$out/wsum_kernel.log"
timeout 270 python3 -m pytest -m gpu -v -s -o timeout=150 tests/test_weight_sync_gpu.py tests/test_trainer_gpu.py tests/test_rollout_device.py tests/test_trainer_compile.py 2>&1 | tee "$out/gpu_tests.log"
stamp "gpu tests exit ${PIPESTATUS[0]}"
# The whole pipeline on this one GPU: reference engine and trainer on CUDA, weights by CUDA IPC, bf16.
timeout 240 python3 -m commands.main run --model tiny --steps 4 --rollout.engine reference --rollout.device cuda \
  --trainer.device cuda --precision bf16 --rollout.dtype bfloat16 --skip_preflight --eval_size 8 \
  --groups_per_step 2 --group_size 4 --out "$out/pipeline_run" 2>&1 | tee "$out/pipeline_run.log"
stamp "one-GPU pipeline run exit ${PIPESTATUS[0]}"
python3 - "$out/pipeline_run" <<'PY' 2>&1 | tee "$out/pipeline_k3.log"
import json, sys
from pathlib import Path
for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    print("step", row.get("step"), "own-version k3", row.get("mismatch_k3_own_version"), "max", row.get("mismatch_max_abs"))
PY
# The bf16 trainer's forward against the reference engine's token-by-token bf16 decode, on CUDA (ours vs autocast).
# (tiny: it is built here; SmolLM2's weights cannot be downloaded on the GPU host.)
timeout 120 python3 bench/bf16_forward.py --device cuda --model tiny 2>&1 | tee "$out/bf16_forward_tiny.log"
stamp "bf16_forward bench exit ${PIPESTATUS[0]}"
# A real-size step: Qwen2.5-1.5B's shape, randomly initialised (no download), ours vs plain per micro-batch.
timeout 300 python3 bench/trainer_step.py --shape qwen2.5-1.5b --device cuda --precision bf16 --groups 8 --group_size 8 \
  --prompt_len 128 --completion_len 896 --micro_batch_size 4,8 --repeats 3 2>&1 | tee "$out/trainer_step_1.5b.log"
stamp "trainer_step 1.5b bench exit ${PIPESTATUS[0]}"
# The weight history's host copies (each publish, each own-version load): pinned (ours) vs pageable, 6 GiB.
timeout 120 python3 bench/history_copy.py --device cuda --mb 6144 --repeats 3 2>&1 | tee "$out/history_copy.log"
stamp "history_copy bench exit ${PIPESTATUS[0]}"
# The float32 head alone: chunked (ours) vs the whole [T, V] under autograd, fp32 and bf16 backward GEMMs.
for grad in float32 bfloat16; do
  timeout 90 python3 bench/head_logprobs.py --device cuda --tokens 4096 --grad_dtype $grad --repeats 3 2>&1 | tee "$out/head_$grad.log"
  stamp "head_logprobs bench ($grad) exit ${PIPESTATUS[0]}"
done
# The 1.5B step with trainer.compile inductor (plain stays eager); ours' warm-up round holds the compile time.
timeout 300 python3 bench/trainer_step.py --shape qwen2.5-1.5b --device cuda --precision bf16 --groups 8 --group_size 8 \
  --prompt_len 128 --completion_len 896 --micro_batch_size 4 --repeats 2 --compile inductor 2>&1 | tee "$out/trainer_step_1.5b_compile.log"
stamp "trainer_step 1.5b compile bench exit ${PIPESTATUS[0]}"
# Measured on earlier leases (docs/benchmarks.md#gpu): the tiny step and the weight path.
timeout 90 python3 bench/trainer_step.py --model tiny --device cuda --repeats 3 2>&1 | tee "$out/trainer_step_tiny.log"
stamp "trainer_step bench exit ${PIPESTATUS[0]}"
timeout 90 python3 bench/cuda_ipc.py --mb 1024 --repeats 3 2>&1 | tee "$out/cuda_ipc.log"
stamp "cuda_ipc bench exit ${PIPESTATUS[0]}"
timeout 150 python3 bench/ipc_update.py --mb 1024 --repeats 3 2>&1 | tee "$out/ipc_update.log"
stamp "ipc_update bench exit ${PIPESTATUS[0]}"
