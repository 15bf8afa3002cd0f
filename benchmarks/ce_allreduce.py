"""An experiment for issue 7: how fast could a two-GPU all_reduce go if the copy engines moved
the data instead of SM stores? One process drives both GPUs (CuPy); a two-shot all_reduce in
--chunks pieces, pipelined over two streams per GPU:

  1. GPU g copies (cudaMemcpyPeerAsync) its values of the peer's half into the peer's scratch
     (a stream of its own for these pushes, so they never queue behind step 3);
  2. the peer adds them into its own half (an elementwise kernel: local reads and writes);
  3. the reduced chunk is copied back into g's array: pushed by the peer, or pulled by g
     (--back; each GPU's "back" stream).

Prints busbw (= S / time for 2 GPUs) for each size, checked against the expected sums, beside
the copy engines' both-ways rate (link_ceiling.py) that bounds it. Not anyccl's code path: a
measurement of what the copy-engine design would reach before building it.

    python3 benchmarks/ce_allreduce.py [--mib 256 1024] [--chunks 1 4 16 64] [--repeat 5]
                                       [--back push pull]
"""

from __future__ import annotations

import argparse

import cupy
from cupy.cuda import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--mib", type=int, nargs="+", default=[256, 1024])
parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16, 64])
parser.add_argument("--repeat", type=int, default=5)
parser.add_argument("--back", nargs="+", default=["push", "pull"], choices=["push", "pull"],
                    help="step 3 queued on the reducing GPU (push) or on the receiving one "
                         "(pull: its engine reads the peer's memory, as anyccl's ce.py does)")
args = parser.parse_args()

if runtime.getDeviceCount() < 2:
    raise SystemExit("ce_allreduce.py needs 2 GPUs")
for a, b in ((0, 1), (1, 0)):
    with cupy.cuda.Device(a):
        if runtime.deviceCanAccessPeer(a, b):
            runtime.deviceEnablePeerAccess(b)
# holds device 0's first stream while the host queues a whole run (timing the GPU, not the host)
_sleep = cupy.RawKernel(r"""
extern "C" __global__ void hold(long long ns) {
    for (long long t = 0; t < ns; t += 1000000) __nanosleep(1000000);
}""", "hold")


def run(mib: int, chunks: int, back: str) -> tuple[float, bool]:
    """(best seconds of --repeat, result correct) for an all_reduce of `mib` MiB of float32."""
    n = (mib << 20) // 4
    half = n // 2
    per = half // chunks
    x, scratch, copy_s, add_s, back_s = [], [], [], [], []
    for g in range(2):
        with cupy.cuda.Device(g):
            x.append(cupy.empty(n, dtype=cupy.float32))
            scratch.append(cupy.empty(half, dtype=cupy.float32))
            copy_s.append(cupy.cuda.Stream(non_blocking=True))
            add_s.append(cupy.cuda.Stream(non_blocking=True))
            back_s.append(cupy.cuda.Stream(non_blocking=True))
    best = float("inf")
    for _ in range(args.repeat + 1):
        for g in range(2):
            with cupy.cuda.Device(g):
                x[g][...] = g + 1.0               # the sum everywhere is 3
                runtime.deviceSynchronize()
        with cupy.cuda.Device(0):
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            _sleep((1,), (1,), (cupy.int64(30_000_000),), stream=copy_s[0])  # 30 ms
            begin.record(copy_s[0])
        for g in range(2):
            with cupy.cuda.Device(g):
                for s in (copy_s[g], back_s[g]):
                    s.wait_event(begin)
        for k in range(chunks):
            for g in range(2):                       # 1: my values of the peer's half, to it
                p = 1 - g
                lo = p * half + k * per
                with cupy.cuda.Device(g):
                    runtime.memcpyPeerAsync(scratch[p].data.ptr + k * per * 4, p,
                                            x[g].data.ptr + lo * 4, g, per * 4, copy_s[g].ptr)
                    sent = cupy.cuda.Event(disable_timing=True)
                    sent.record(copy_s[g])
                with cupy.cuda.Device(p):            # 2: the peer reduces that chunk
                    add_s[p].wait_event(sent)
                    with add_s[p]:
                        mine = x[p][lo:lo + per]
                        mine += scratch[p][k * per:(k + 1) * per]
                    reduced = cupy.cuda.Event(disable_timing=True)
                    reduced.record(add_s[p])
                returner = p if back == "push" else g   # 3: the chunk goes back to g
                with cupy.cuda.Device(returner):
                    back_s[returner].wait_event(reduced)
                    runtime.memcpyPeerAsync(x[g].data.ptr + lo * 4, g, x[p].data.ptr + lo * 4,
                                            p, per * 4, back_s[returner].ptr)
        for g in range(2):
            with cupy.cuda.Device(g):
                done = cupy.cuda.Event(disable_timing=True)
                done.record(back_s[g])
            with cupy.cuda.Device(0):
                copy_s[0].wait_event(done)
        with cupy.cuda.Device(0):
            end.record(copy_s[0])
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(begin, end) / 1e3)
    correct = True
    for g in range(2):
        with cupy.cuda.Device(g):
            runtime.deviceSynchronize()
            correct = correct and bool((x[g][:2 * half] == 3.0).all())
    return best, correct


print(f"two-GPU all_reduce by copy engines (float32, best of {args.repeat}); busbw = S / time")
for mib in args.mib:
    for chunks, back in ((c, b) for c in args.chunks for b in args.back):
        seconds, ok = run(mib, chunks, back)
        print(f"  {mib:5d} MiB  {chunks:3d} chunks  back by {back:<4}  {seconds * 1e6:9.1f} us  "
              f"{(mib << 20) / seconds / 1e9:7.1f} GB/s  {'ok' if ok else 'WRONG'}", flush=True)
