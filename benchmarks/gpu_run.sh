#!/usr/bin/env bash
# The GPU runs, on a GPU machine: install the wheels in .whl/ (nccl4py and whatever else the
# machine lacks), describe the machine, then run the named steps in order. Usage (from the repository root):
#   bash benchmarks/gpu_run.sh STEP [STEP ...]
# Steps: tests (GPU tests, nccl), staging (GPU tests on mpi, host-staged), ipc (GPU tests of the
# ipc backend), overhead (host time per call), mpibench (staged vs naive all_reduce), ddp
# (overlap step times), examples (every example on the GPUs), small (8 B - 8 MiB all_reduce vs
# torch), large (16 MiB - 1 GiB, four ops, vs torch), ipccheck (1000 random ipc ops vs float64),
# sanitizer (compute-sanitizer on a small ipc run), ipcsmall / ipclarge (anyccl bench: ipc vs
# anyccl-nccl vs torch), ipcp2p (one-way send/recv bandwidth), scale (five collectives, MIN to
# MAX: anyccl auto beside anyccl ipc, anyccl nccl and torch, on every GPU), links (copy-engine
# rates between the GPUs: the rooflines), ce (a copy-engine two-shot all_reduce: an
# experiment), cemodes (anyccl's copy-engine all_reduce per flag mechanism and chunks, beside
# the SM kernels and torch: lab/ce_modes.py with CEMODES_ARGS), probe (eager host loops, anyccl
# vs torch: lab/host_probe.py), calls (host time of the driver calls each operation makes:
# lab/cuda_call_cost.py), eager (8 B - 1 MiB eager calls: all_reduce on ipc beside nccl, torch
# and torch's symmetric memory; the other ipc ops beside nccl and torch; every op on nccl beside
# torch), graph (the four ipc ops as CUDA graph replays), replay (each step of a repeated call's
# host time: lab/replay_cost.py), pace (eager all_reduce loops of anyccl ipc, torch symm_mem
# and torch NCCL timed as host issue, eager and graph replay time per call: lab/eager_pace.py
# $PACE_SIZES), torchtests (the torch backend's GPU tests), torchsmoke (the
# torch backend's collectives and DDP/FSDP2/averager on a small model, on however many GPUs), torchddp (torch DDP,
# FSDP2 and the GradientAverager on anyccl groups vs DDP on NCCL: float32 and bfloat16, 201M
# parameters; PROFILE=1 adds rank 0's torch.profiler tables), tune (anyccl tune: the auto
# policy's routes for this machine shape), sweep (the ipc kernels' blocks, tiles, takers and
# all_reduce algorithms beside torch's NCCL: lab/ipc_sweep.py $SWEEP_ARGS), autovs (auto beside torch's NCCL, six ops, $DTYPE), pack (everything in $RESULTS_DIR into one gpu-out.tgz: last).
# MIN/MAX change small's, large's and scale's sizes, ROUNDS the bench rounds (3); CE_ARGS are
# ce_allreduce.py's arguments (e.g. "--sync events memops").
# N=k runs the multi-rank steps on k ranks (default: one per visible GPU); K=expr selects ipc tests.
# Logs go to $RESULTS_DIR (default ./gpu-out). NVLink multicast stays off (shared machines).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
RESULTS_DIR=${RESULTS_DIR:-gpu-out}; mkdir -p "$RESULTS_DIR"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD/src:/tmp/site
# the compiled cores (shm transport, op records, CUDA calls), as `pip install -e .` would build
# them (skipped without gcc)
core_so=src/anyccl/backends/_shmcore$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
[ -e "$core_so" ] || gcc -O3 -shared -fPIC -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    src/anyccl/backends/_shmcore.c -o "$core_so" 2>/dev/null || echo "shm core not built: Python path"
record_so=src/anyccl/_recordcore${core_so##*_shmcore}
[ -e "$record_so" ] || gcc -O2 -shared -fPIC -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    src/anyccl/_recordcore.c -o "$record_so" 2>/dev/null || echo "record core not built: trace.py's class"
cuda_so=src/anyccl/_cudacore${core_so##*_shmcore}
[ -e "$cuda_so" ] || gcc -O2 -shared -fPIC -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    src/anyccl/_cudacore.c -o "$cuda_so" -ldl 2>/dev/null || echo "CUDA core not built: cuda-bindings path"
# the torch process group's compiled part, built once here rather than inside a timed step
python3 -c "from anyccl import torch_core; torch_core.load(); print('torch group:', torch_core.status())" \
    2>/dev/null || echo "torch group: its Python code (torch not importable)"
anyccl() { python3 -m anyccl "$@"; }
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m; anyccl info; python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
} > "$RESULTS_DIR/info.txt" 2>&1
n=${N:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
step() { echo "=== $1 ($(date +%T))"; }
# anyccl bench on the GPUs: bench NAME TIMEOUT BACKEND COMPARE OPS MIN MAX; $FACTOR (4), $ROUNDS
# and $GRAPH apply; writes $RESULTS_DIR/NAME.json and NAME.txt and prints the comparison tables
bench() {
  local name=$1 limit=$2 backend=$3 compare=$4 ops=$5 min=$6 max=$7
  timeout "$limit" python3 -m anyccl bench -n "$n" --device cuda --backend "$backend" \
      --compare "$compare" --op "$ops" --min "$min" --max "$max" --factor "${FACTOR:-4}" \
      ${ROUNDS:+--rounds "$ROUNDS"} ${GRAPH:+--graph} ${DTYPE:+--dtype "$DTYPE"} --json "$RESULTS_DIR/$name.json" 2>&1 | tee "$RESULTS_DIR/$name.txt" \
      | awk '/busbw \(GB\/s/,/latency at the smallest/' | tail -100
}
FOUR=all_reduce,all_gather,reduce_scatter,broadcast
for what in "$@"; do
  case $what in
  tests) step tests
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -rfE --tb=short -m gpu tests/test_gpu.py \
        -p no:cacheprovider 2>&1 | tee "$RESULTS_DIR/gpu-tests.txt" | tail -15 ;;
  torchtests) step torchtests
    timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -rfE --tb=short -m gpu tests/test_gpu_torch_backend.py \
        -p no:cacheprovider 2>&1 | tee "$RESULTS_DIR/gpu-torch-backend-tests.txt" | tail -15 ;;
  torchsmoke) step torchsmoke  # the torch backend on the GPUs there are (one is enough)
    for t in nccl ipc; do
      ANYCCL_BACKEND=$t timeout 240 python3 tests/scripts/torch_cuda_collectives.py "$n" 29571 \
          && echo "torch_cuda_collectives.py on $n rank(s), $t: passed"
    done 2>&1 | tee "$RESULTS_DIR/torch-smoke.txt" | tail -20
    timeout 300 python3 benchmarks/torch_ddp_backends.py --device cuda --ranks "$n" --width 256 \
        --layers 3 --steps 3 --rounds 1 --variants "${VARIANTS:-ddp:nccl,ddp:anyccl-ipc,ddp:anyccl-nccl,fsdp2:nccl,fsdp2:anyccl-auto,averager:anyccl-auto,averager:anyccl-ipc}" \
        2>&1 | tee -a "$RESULTS_DIR/torch-smoke.txt" | tail -20 ;;
  torchddp) step torchddp  # torch DDP / FSDP2 / GradientAverager on anyccl vs on NCCL, the 201M model
    for dtype in ${DTYPES:-float32 bfloat16}; do
      timeout "${DDP_TIMEOUT:-200}" python3 benchmarks/torch_ddp_backends.py --device cuda --ranks "$n" \
          --width 4096 --layers 12 --batch 64 --dtype "$dtype" --steps "${STEPS:-20}" --rounds "${ROUNDS:-3}" \
          ${VARIANTS:+--variants "$VARIANTS"} ${PROFILE:+--profile "$RESULTS_DIR/profile-$dtype"} 2>&1 \
          | grep -v "^USDT\|profiler_st" | tee -p "$RESULTS_DIR/torch-ddp-$dtype.txt" | head -14
    done ;;
  staging) step staging
    timeout "${STAGING_TIMEOUT:-120}" python3 -m pytest -q -rfE --tb=short -m gpu tests/test_gpu_staging.py \
        -p no:cacheprovider 2>&1 | tee "$RESULTS_DIR/gpu-staging-tests.txt" | tail -15 ;;
  ipc) step ipc
    timeout "${IPC_TIMEOUT:-200}" python3 -m pytest -q -rfE --tb=short -m gpu tests/test_gpu_ipc.py ${K:+-k "$K"} \
        -p no:cacheprovider 2>&1 | tee "$RESULTS_DIR/gpu-ipc-tests.txt" | tail -25 ;;
  overhead) step overhead
    for b in ${OVERHEAD_BACKENDS:-nccl ipc}; do
      timeout 90 python3 benchmarks/lab/gpu_overhead.py $b 2>&1 | tee "$RESULTS_DIR/overhead-$b.txt" | tail -36
    done ;;
  mpibench) step mpibench
    timeout 120 mpiexec -n "$n" python3 benchmarks/mpi_staging.py --mib 16 64 256 2>&1 \
        | tee "$RESULTS_DIR/mpi-staging.txt" | tail -12 ;;
  ddp) step ddp
    for b in ${DDP_BACKENDS:-nccl}; do
      timeout 150 python3 -m anyccl run -n "$n" benchmarks/ddp_overlap.py --backend "$b" 2>&1 \
          | tee "$RESULTS_DIR/ddp-overlap-$b-$n.txt" | tail -6
    done ;;
  examples) step examples
    timeout 240 bash benchmarks/gpu_examples.sh "$n" 2>&1 | tee "$RESULTS_DIR/examples.txt" | tail -40 ;;
  small) step small
    bench bench-small 100 nccl torch all_reduce "${MIN:-8}" "${MAX:-8M}" ;;
  large) step large
    bench "bench-large-${MIN:-16M}-${MAX:-1G}" "${BENCH_TIMEOUT:-240}" nccl torch "${OPS:-$FOUR}" \
        "${MIN:-16M}" "${MAX:-1G}" ;;
  ipccheck) step ipccheck
    timeout "${CHECK_TIMEOUT:-240}" python3 -m anyccl run -n "$n" benchmarks/ipc_check.py \
        --iters "${ITERS:-1000}" 2>&1 | tee "$RESULTS_DIR/ipc-check.txt" | tail -25 ;;
  sanitizer) step sanitizer
    for tool in ${TOOLS:-memcheck racecheck}; do
      ANYCCL_IPC_HALF_MB=2 ANYCCL_IPC_RING_MB=4 timeout 150 compute-sanitizer --tool $tool \
          --target-processes all --print-limit 20 python3 -m anyccl run -n "$n" \
          benchmarks/ipc_check.py --iters 25 --max-elems 200000 2>&1 \
          | tee "$RESULTS_DIR/sanitizer-$tool.txt" | tail -8
    done ;;
  eager) step eager  # eager calls 8 B - 1 MiB: the strongest peers of each op in one table
    bench eager-all-reduce "${BENCH_TIMEOUT:-200}" ipc nccl,torch,symm all_reduce "${MIN:-8}" "${MAX:-1M}"
    bench eager-ipc "${BENCH_TIMEOUT:-200}" ipc nccl,torch all_gather,reduce_scatter,broadcast \
        "${MIN:-8}" "${MAX:-1M}"
    bench eager-nccl "${BENCH_TIMEOUT:-200}" nccl torch all "${MIN:-8}" "${MAX:-1M}" ;;
  graph) step graph  # the same calls captured in CUDA graphs: the GPU's time alone
    GRAPH=1 bench graph-ipc "${BENCH_TIMEOUT:-200}" ipc nccl,torch "$FOUR" "${MIN:-8}" "${MAX:-1M}" ;;
  ipcsmall) step ipcsmall
    bench "ipc-small${GRAPH:+-graph}" 200 "${IPC_BACKEND:-ipc}" nccl,torch "${OPS:-all_reduce}" 8 \
        "${SMALL_MAX:-8M}" ;;
  ipclarge) step ipclarge
    bench ipc-large "${BENCH_TIMEOUT:-240}" "${IPC_BACKEND:-ipc}" nccl,torch "${OPS:-$FOUR}" 16M 1G ;;
  ipcp2p) step ipcp2p
    timeout 150 python3 -m anyccl run -n 2 benchmarks/ipc_p2p.py 2>&1 \
        | tee "$RESULTS_DIR/ipc-p2p.txt" | tail -12 ;;
  replay) step replay
    for b in ${REPLAY_BACKENDS:-ipc nccl}; do
      timeout 120 python3 -m anyccl run -n "$n" benchmarks/lab/replay_cost.py "$b" 2>&1 \
          | grep -v Warning | tee -p "$RESULTS_DIR/replay-cost-$b.txt" | head -60
    done ;;
  calls) step calls
    timeout 60 python3 benchmarks/lab/cuda_call_cost.py 2>&1 | tee "$RESULTS_DIR/cuda-call-cost.txt" | tail -8 ;;
  pace) step pace  # what sets an eager loop's pace: host, eager and graph time per call
    timeout 240 python3 -m anyccl run -n "$n" benchmarks/lab/eager_pace.py ${PACE_SIZES:-} 2>&1 \
        | grep -v Warning | tee "$RESULTS_DIR/eager-pace.txt" | tail -90 ;;
  probe) step probe
    timeout 150 python3 -m anyccl run -n 2 benchmarks/lab/host_probe.py 2>&1 | grep -v Warning \
        | tee "$RESULTS_DIR/host-probe.txt" | tail -16 ;;
  ce) step ce
    timeout 120 python3 benchmarks/lab/ce_allreduce.py ${CE_ARGS:-} 2>&1 | tee "$RESULTS_DIR/ce-allreduce.txt" \
        | tail -20 ;;
  cemodes) step cemodes
    timeout "${CEMODES_TIMEOUT:-300}" python3 -m anyccl run -n "$n" benchmarks/lab/ce_modes.py ${CEMODES_ARGS:-} \
        2>&1 | tee "$RESULTS_DIR/ce-modes.txt" | tail -40 ;;
  links) step links
    timeout 120 python3 benchmarks/roofline/link_ceiling.py 2>&1 | tee "$RESULTS_DIR/link-ceiling.txt" | tail -8 ;;
  sweep) step sweep  # the ipc kernels' configurations beside torch's NCCL: lab/ipc_sweep.py $SWEEP_ARGS
    timeout "${SWEEP_TIMEOUT:-300}" python3 -m anyccl run -n "$n" benchmarks/lab/ipc_sweep.py ${SWEEP_ARGS:-} 2>&1 \
        | grep -v Warning | tee -a "$RESULTS_DIR/sweep-$n.txt" ;;
  tune) step tune  # anyccl tune on N ranks: the routes into ANYCCL_ROUTES_FILE (or the cache)
    timeout "${TUNE_TIMEOUT:-300}" python3 -m anyccl tune -n "$n" 2>&1 | grep -v Warning \
        | tee "$RESULTS_DIR/tune-$n.txt" ;;
  autovs) step autovs  # auto (the routes in force) beside torch's NCCL: six ops, MIN..MAX, $DTYPE
    bench "auto-vs-nccl-$n-${DTYPE:-float32}" "${BENCH_TIMEOUT:-400}" auto torch \
        "${OPS:-$FOUR,reduce,all_to_all}" "${MIN:-16}" "${MAX:-1G}" ;;
  scale) step scale
    bench "scale-$n-${MIN:-16}-${MAX:-1G}${GRAPH:+-graph}" "${BENCH_TIMEOUT:-500}" auto \
        ipc,nccl,torch "${OPS:-$FOUR,all_to_all}" "${MIN:-16}" "${MAX:-1G}" ;;
  pack) step pack  # one archive of every log, for copying off the machine
    tar czf /tmp/gpu-out.tgz -C "$RESULTS_DIR" . && rm -rf "${RESULTS_DIR:?}"/* && mv /tmp/gpu-out.tgz "$RESULTS_DIR/" ;;
  *) echo "unknown step $what"; exit 2 ;;
  esac
done
echo "=== end ($(date +%T))"
