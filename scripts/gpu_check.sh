#!/usr/bin/env bash
# Every GPU check in one go, on a GPU host (see docs/gpu.md): the gpu-marked tests, then the GPU benches.
#   bash ../shared/gpu/carry-deps.sh          # here, after scripts/setup.sh: builds .gpu/ (wheels + redis-server)
#   source .gpu/env.sh && bash scripts/gpu_check.sh      # there; logs go to $OUT (or runs/gpu-check)
# Each step has its own time limit, so one hang cannot eat the whole lease.
set -uo pipefail
out=${OUT:-runs/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$out/host.log"
# The one-pass checksum kernel is not carried (a build output): build it here, or warn and use numpy.
python3 -m parity.weights.wsum_kernel 2>&1 | tee "$out/wsum_kernel.log"
timeout 270 python3 -m pytest -m gpu -v -s -o timeout=150 tests/test_weight_sync_gpu.py tests/test_trainer_gpu.py 2>&1 | tee "$out/gpu_tests.log"
echo "gpu tests exit ${PIPESTATUS[0]}"
timeout 90 python3 bench/cuda_ipc.py --mb 1024 --repeats 3 2>&1 | tee "$out/cuda_ipc.log"
echo "cuda_ipc bench exit ${PIPESTATUS[0]}"
timeout 150 python3 bench/ipc_update.py --mb 1024 --repeats 3 2>&1 | tee "$out/ipc_update.log"
echo "ipc_update bench exit ${PIPESTATUS[0]}"
timeout 90 python3 bench/trainer_step.py --model tiny --device cuda --repeats 3 2>&1 | tee "$out/trainer_step_tiny.log"
echo "trainer_step bench exit ${PIPESTATUS[0]}"
