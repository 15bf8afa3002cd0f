#!/usr/bin/env bash
# One call on the device machine: install the carried wheels, describe the machine, run the GPU
# tests and the nccl bench against torch.distributed. Usage (from the repository root):
#   bash benchmarks/gpu_run.sh [tests|bench|all] [pytest -k expression]
# Writes logs to $OUT (or ./gpu-out). NVLink multicast stays off (shared machines).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
mode=${1:-all}; filter=${2:-}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site
anyccl() { python3 -m anyccl "$@"; }
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m; anyccl info; python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
} 2>&1 | tee "$OUT/info.txt"
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
timeout 60 python3 -m anyccl run -n "$n" benchmarks/gpu_smoke.py 2>&1 | tee "$OUT/smoke.txt"
if [[ $mode == tests || $mode == all ]]; then
    timeout "${TESTS_TIMEOUT:-230}" python3 -m pytest -v -rA --tb=short -m gpu tests/test_gpu.py \
        ${filter:+-k "$filter"} -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.txt"
    pkill -9 -f multiprocessing.spawn || true   # ranks of a pool a timeout left behind
fi
if [[ $mode == bench || $mode == all ]]; then
    timeout 90 python3 -m anyccl bench -n "$n" --device cuda --op all_reduce --min 8 --max 8M \
        --factor 4 --compare torch --json "$OUT/bench-small.json" 2>&1 \
        | tee "$OUT/bench-small.txt"
    timeout "${BENCH_TIMEOUT:-190}" python3 -m anyccl bench -n "$n" --device cuda \
        --op all_reduce,all_gather,reduce_scatter,broadcast --min 16M --max 1G \
        --factor "${FACTOR:-4}" --compare torch --json "$OUT/bench-large.json" 2>&1 \
        | tee "$OUT/bench-large.txt"
fi
