#!/usr/bin/env bash
# Every example on the GPUs of a GPU machine, one rank per GPU (run by gpu_run.sh examples).
# Each example checks its own result and exits non-zero when wrong; this prints PASS/FAIL lines.
set -uo pipefail
n=${1:-2}
cd "$(dirname "$0")/.."
run() {  # label, command...
  local label=$1; shift
  local t0=$SECONDS
  if timeout 90 "$@" > /tmp/example.log 2>&1; then status=PASS; else status="FAIL rc=$?"; fi
  sed 's/^/    /' /tmp/example.log | tail -12
  echo "$status  $label  ($((SECONDS - t0)) s)"
}
A="python3 -m anyccl run -n $n"
run "gradient_average nccl" $A examples/gradient_average.py --device cuda --size 16777216
run "gradient_average mpi (host-staged)" mpiexec -n "$n" python3 examples/gradient_average.py \
    --device cuda --backend mpi --size 16777216
run "ping_pong" $A examples/ping_pong.py --device cuda
for ex in hello_collectives async_send_recv collectives_tour single_layer_classifier; do
  if grep -q -- '--device' "examples/$ex.py"; then
    run "$ex" $A "examples/$ex.py" --device cuda
  else
    echo "SKIP  $ex (no --device option)"
  fi
done
run "train_mlp --torch" $A examples/train_mlp.py --torch --device cuda
