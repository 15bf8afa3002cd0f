"""An experiment for issue 7: how fast could a two-GPU all_reduce go if the copy engines moved
the data instead of SM stores? One process drives both GPUs (CuPy); a two-shot all_reduce in
--chunks pieces, pipelined over two streams per GPU:

  1. GPU g copies (cudaMemcpyPeerAsync) its values of the peer's half into the peer's scratch;
  2. the peer adds them into its own half (an elementwise kernel: local reads and writes);
  3. the peer copies its reduced chunk back into g's array.

Prints busbw (= S / time for 2 GPUs) for each size, checked against the expected sums, beside
the copy engines' both-ways rate (link_ceiling.py) that bounds it. Not anyccl's code path: a
measurement of what the copy-engine design would reach before building it.

    python3 benchmarks/ce_allreduce.py [--mib 256 1024] [--chunks 1 4 16] [--repeat 5]
"""

from __future__ import annotations

import argparse

import cupy
from cupy.cuda import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--mib", type=int, nargs="+", default=[256, 1024])
parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16])
parser.add_argument("--repeat", type=int, default=5)
args = parser.parse_args()

if runtime.getDeviceCount() < 2:
    raise SystemExit("ce_allreduce.py needs 2 GPUs")
for a, b in ((0, 1), (1, 0)):
    with cupy.cuda.Device(a):
        if runtime.deviceCanAccessPeer(a, b):
            runtime.deviceEnablePeerAccess(b)


def run(mib: int, chunks: int) -> tuple[float, bool]:
    """(best seconds of --repeat, result correct) for an all_reduce of `mib` MiB of float32."""
    n = (mib << 20) // 4
    half = n // 2
    per = half // chunks
    x, scratch, copy_s, add_s = [], [], [], []
    for g in range(2):
        with cupy.cuda.Device(g):
            x.append(cupy.empty(n, dtype=cupy.float32))
            scratch.append(cupy.empty(half, dtype=cupy.float32))
            copy_s.append(cupy.cuda.Stream(non_blocking=True))
            add_s.append(cupy.cuda.Stream(non_blocking=True))
    best = float("inf")
    for _ in range(args.repeat + 1):
        for g in range(2):
            with cupy.cuda.Device(g):
                x[g][...] = g + 1.0               # the sum everywhere is 3
                runtime.deviceSynchronize()
        with cupy.cuda.Device(0):
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            begin.record(copy_s[0])
        with cupy.cuda.Device(1):
            copy_s[1].wait_event(begin)
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
                    copy_s[p].wait_event(reduced)    # 3: and sends it back to g
                    runtime.memcpyPeerAsync(x[g].data.ptr + lo * 4, g, x[p].data.ptr + lo * 4,
                                            p, per * 4, copy_s[p].ptr)
        with cupy.cuda.Device(1):
            done1 = cupy.cuda.Event(disable_timing=True)
            done1.record(copy_s[1])
        with cupy.cuda.Device(0):
            copy_s[0].wait_event(done1)
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
    for chunks in args.chunks:
        seconds, ok = run(mib, chunks)
        print(f"  {mib:5d} MiB  {chunks:3d} chunks  {seconds * 1e6:9.1f} us  "
              f"{(mib << 20) / seconds / 1e9:7.1f} GB/s  {'ok' if ok else 'WRONG'}", flush=True)
