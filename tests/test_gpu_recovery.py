"""Losing a rank on GPUs: one of up to 4 ranks, each on its own GPU, is killed (SIGKILL) in the
middle of a loop of GPU all_reduces on the nccl or the ipc backend; the survivors' queued GPU
work is cut short (the NCCL communicator aborted, the kernels told to return), every survivor
shrinks, and the shrunk communicator's first GPU all_reduce (a new GPU communicator of the
survivors alone) and every host collective are right (tests/scripts/shrink_after_kill.py
checks them). And `comm.abort()` ends this rank's GPU work that waits on a peer at once. Needs
2 CUDA GPUs or more; skipped without. The printed lines give the times recorded in
benchmarks/results."""

from __future__ import annotations

import re
import time

import pytest
from harness import run_ranks
from test_gpu import two_gpus
from test_recovery import DONE, _job

import anyccl
from anyccl import gpu

pytestmark = pytest.mark.gpu
TIMES = re.compile(r"rank (\d+) of \d+ -> .*seconds=([\d.]+) first=([\d.]+) detect=([-\d.]+)")


@two_gpus()
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
@pytest.mark.parametrize("nbytes", [1 << 14, 64 << 20])
def test_gpu_survivors_of_a_kill_shrink_and_go_on(backend, nbytes, tmp_path):
    n = min(4, gpu.device_count())
    kills = tmp_path / "kills"
    start = time.monotonic()
    code, text = _job(n, str(n - 1), timeout_s=170, DEVICE="cuda", NBYTES=str(nbytes),
                      ANYCCL_BACKEND=f"cpu:shm,cuda:{backend}", KILL_FILE=str(kills),
                      NCCL_NVLS_ENABLE="0")
    done = {int(m[1]): m for m in DONE.finditer(text)}
    assert code == 0 and sorted(done) == list(range(n - 1)), text[-4000:]
    for m in done.values():
        assert int(m[4]) == n - 1 and m[5] == str(n - 1), m[0]
    times = list(TIMES.finditer(text))
    assert sorted(int(t[1]) for t in times) == list(range(n - 1)), text[-2000:]
    detect = max(float(t[4]) for t in times)
    shrink = max(float(t[2]) for t in times)
    first = max(float(t[3]) for t in times)
    print(f"{n} GPUs, {backend}, {nbytes} B all_reduces: kill -> error {detect:.3f} s, error -> "
          f"shrunk {shrink:.3f} s, error -> first GPU all_reduce done {first:.3f} s "
          f"(slowest survivor; job {time.monotonic() - start:.1f} s)")
    assert detect < 10 and first < 30, text[-2000:]


def check_abort_ends_gpu_work_at_once(comm):
    import threading

    import torch

    torch.cuda.set_device(comm.device)
    x = torch.ones(1 << 20, device=f"cuda:{comm.device}")
    comm.all_reduce(x)                          # the GPU communicator exists on both ranks
    torch.cuda.synchronize()
    start = time.monotonic()
    if comm.rank == 0:
        comm.all_reduce(x)                      # queued: rank 1 does not come for 8 s
        threading.Timer(0.5, comm.abort).start()
        torch.cuda.synchronize()                # returns once the abort cut it short
        took = time.monotonic() - start
        with pytest.raises(anyccl.CommunicatorClosedError):
            comm.all_reduce(x)
        return took
    time.sleep(8)
    with pytest.raises(anyccl.PeerLostError, match="rank 0"):
        comm.barrier()
    return time.monotonic() - start - 8


@two_gpus()
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_abort_cuts_gpu_work_waiting_on_a_peer_short(backend):
    took = run_ranks(check_abort_ends_gpu_work_at_once, 2, deadline_s=90,
                     env={"ANYCCL_BACKEND": f"cpu:shm,cuda:{backend}", "ANYCCL_TIMEOUT": "60",
                          "NCCL_NVLS_ENABLE": "0"})
    print(f"{backend}: abort -> GPU work done {took[0] - 0.5:.3f} s; the peer's next "
          f"collective failed after {took[1]:.3f} s")
    assert took[0] < 5 and took[1] < 5, took
