#!/usr/bin/env bash
# Every GPU check in one go, on a GPU host (see docs/gpu.md): the gpu-marked tests, then the GPU benches.
#   bash ../shared/gpu/carry-deps.sh          # here, after scripts/setup.sh: builds .gpu/ (wheels + redis-server)
#   source .gpu/env.sh && bash scripts/gpu_check.sh      # there; logs go to $OUT (or runs/gpu-check)
# Each step has its own time limit, so one hang cannot eat the whole lease. The steps run in order of
# what is least known: what has never run on a GPU first, the benches earlier leases measured last, so
# a lease cut short still brings back the new figures (every log is written as it goes).
# The whole script keeps within GPU_CHECK_BUDGET_S (default 540 s: a lease's command may run 600 s):
# a step's limit shrinks to what is left, and a step with under 30 s left is skipped and named in
# $out/skipped.txt.
set -uo pipefail
out=${OUT:-runs/gpu-check}
budget=${GPU_CHECK_BUDGET_S:-540}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$SECONDS
stamp() { echo "[gpu_check +$((SECONDS - start))s] $*"; }
# step NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, the budget left), its output in $out/NAME.log.
# At the limit COMMAND's process group gets SIGTERM, and SIGKILL 10 s later if anything is still running
# (a graceful stop that hangs, a test's child process that ignores SIGTERM): a step ends by limit + 10 s.
step() {
  local name=$1 limit=$2 left
  shift 2
  left=$((budget - (SECONDS - start)))
  if ((left < 30)); then
    stamp "$name skipped: ${left}s of the ${budget}s budget left"
    echo "$name" >>"$out/skipped.txt"
    return
  fi
  ((limit > left)) && limit=$left
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  stamp "$name exit ${PIPESTATUS[0]} (limit ${limit}s)"
}
# What a GPU host may lack, none of it fatal: matplotlib (without it `parity run` draws no plots),
# and what Triton needs to build its launcher under trainer.compile inductor (the C compiler it picks:
# $CC, else gcc, else clang; and Python.h) -- without them the CUDA compile tests skip.
{
  nvidia-smi -L
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  python3 -c 'import matplotlib' 2>/dev/null && echo "matplotlib: present" || echo "matplotlib: absent (parity run draws no plots)"
  echo "C compiler (Triton's: \$CC, gcc, clang): ${CC:-$(command -v gcc || command -v clang || echo absent)}; cc: $(command -v cc || echo absent); c++: $(command -v c++ || command -v g++ || echo absent)"
  python3 -c 'import os, sysconfig
scheme = sysconfig.get_default_scheme()
include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
header = os.path.join(include, "Python.h")
print("Python.h:", header if os.path.exists(header) else f"absent (not in {include})")'
} 2>&1 | tee "$out/host.log"
# The one-pass checksum kernel is not carried (a build output): build it here, or warn and use numpy.
python3 -m parity.weights.wsum_kernel 2>&1 | tee "$out/wsum_kernel.log"
# The whole pipeline on this one GPU: reference engine and trainer on CUDA, weights by CUDA IPC, bf16.
# The run's own timeouts end a stall with its own error inside the step's limit: each service has 90 s
# to report SERVING (torch, CUDA and the tiny model load in seconds), each step 60 s (on CPU the whole
# run takes ~16 s); the defaults (600 s, 900 s) would leave the step's timeout to cut the run off.
step pipeline_run 240 python3 -m commands.main run --model tiny --steps 4 --rollout.engine reference --rollout.device cuda \
  --trainer.device cuda --precision bf16 --rollout.dtype bfloat16 --skip_preflight --eval_size 8 \
  --groups_per_step 2 --group_size 4 --startup_timeout_s 90 --step_timeout_s 60 --trainer.await_workers_timeout_s 60 \
  --out "$out/pipeline_run"
python3 scripts/step_mismatch.py "$out/pipeline_run" 2>&1 | tee "$out/pipeline_k3.log"
# A real-size step: Qwen2.5-1.5B's shape, randomly initialised (no download), ours vs plain per micro-batch.
step trainer_step_1.5b 300 python3 bench/trainer_step.py --shape qwen2.5-1.5b --device cuda --precision bf16 --groups 8 --group_size 8 \
  --prompt_len 128 --completion_len 896 --micro_batch_size 4,8 --repeats 3 --profile "$out/profile_1.5b"
step gpu_tests 270 python3 -m pytest -m gpu -v -s -o timeout=150 tests/test_weight_sync_gpu.py tests/test_trainer_gpu.py tests/test_rollout_device.py tests/test_trainer_compile.py tests/test_weight_history.py
# The bf16 trainer's forward against the reference engine's token-by-token bf16 decode, on CUDA (ours vs autocast).
# (tiny: it is built here; SmolLM2's weights cannot be downloaded on the GPU host.)
step bf16_forward_tiny 120 python3 bench/bf16_forward.py --device cuda --model tiny
# The weight history's host copies (each publish, each own-version load): pinned (ours) vs pageable, 6 GiB.
step history_copy 120 python3 bench/history_copy.py --device cuda --mb 6144 --repeats 3
# The head alone: chunked (ours) vs the whole [T, V] under autograd, as fp32 mode runs it (float32 weight,
# float32 backward) and as bf16 mode does (bf16 weight on tensor cores, bf16 backward).
step head_fp32 90 python3 bench/head_logprobs.py --device cuda --tokens 4096 --repeats 3
step head_bf16 90 python3 bench/head_logprobs.py --device cuda --tokens 4096 --weight_dtype bfloat16 --grad_dtype bfloat16 --repeats 3
# The 1.5B step with trainer.compile inductor (plain stays eager); ours' warm-up round holds the compile time.
step trainer_step_1.5b_compile 300 python3 bench/trainer_step.py --shape qwen2.5-1.5b --device cuda --precision bf16 --groups 8 --group_size 8 \
  --prompt_len 128 --completion_len 896 --micro_batch_size 4 --repeats 2 --compile inductor
# Measured on earlier leases (docs/benchmarks.md#gpu): the tiny step and the weight path.
step trainer_step_tiny 90 python3 bench/trainer_step.py --model tiny --device cuda --repeats 3
step cuda_ipc 90 python3 bench/cuda_ipc.py --mb 1024 --repeats 3
step ipc_update 150 python3 bench/ipc_update.py --mb 1024 --repeats 3
[ -s "$out/skipped.txt" ] && stamp "skipped for lack of budget: $(tr '\n' ' ' <"$out/skipped.txt")"
stamp "done"
