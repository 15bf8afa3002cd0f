"""What the links between this machine's GPUs carry with no collective library in the way: copy
engine transfers (cudaMemcpyPeerAsync through CuPy, a stream per pair) of --mib MiB, timed
with CUDA events. One process drives every GPU.

    python3 benchmarks/roofline/link_ceiling.py [--mib 1024] [--repeat 5]

Prints, in GB/s (bytes moved / time, best of --repeat):
  one way      GPU 0 -> GPU 1 alone
  both ways    GPU 0 -> GPU 1 and GPU 1 -> GPU 0 at once (per direction)
  pulled       the same two, each copy queued on the destination GPU (its engine reads the
               peer's memory) instead of the source
  split        GPU 0 -> GPU 1, the bytes cut into 2 or 4 copies on as many streams
  SM stores    GPU 0 -> GPU 1 by a kernel on GPU 0 storing 16-byte words into GPU 1's memory
  engines + SM GPU 0 -> GPU 1, a share by the kernel and the rest by a copy at the same time
  fan out      GPU 0 -> every other GPU at once (GPU 0's total egress)
  all pairs    every GPU -> every other GPU at once (per GPU's egress)
These are the rooflines the bus-bandwidth model of each collective is held against.
"""

from __future__ import annotations

import argparse
import itertools

import cupy
from cupy.cuda import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--mib", type=int, default=1024)
parser.add_argument("--repeat", type=int, default=5)
args = parser.parse_args()

n = runtime.getDeviceCount()
if n < 2:
    raise SystemExit("link_ceiling.py needs at least 2 GPUs")
nbytes = args.mib << 20
pairs_all = list(itertools.permutations(range(n), 2))
src, dst, streams = {}, {}, {}
for a in range(n):
    with cupy.cuda.Device(a):
        for b in range(n):
            if b != a and runtime.deviceCanAccessPeer(a, b):
                runtime.deviceEnablePeerAccess(b)
        src[a] = cupy.ones(nbytes, dtype=cupy.uint8)
pulls = {}
for a, b in pairs_all:
    with cupy.cuda.Device(b):
        dst[a, b] = cupy.empty(nbytes, dtype=cupy.uint8)
        pulls[a, b] = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.Device(a):
        streams[a, b] = cupy.cuda.Stream(non_blocking=True)


_copy = cupy.RawKernel(r"""
extern "C" __global__ void copy16(uint4* __restrict__ dst, const uint4* __restrict__ src,
                                  unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}""", "copy16")
sides = []
with cupy.cuda.Device(0):
    sides = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
    _sms = runtime.getDeviceProperties(0)["multiProcessorCount"]


def one_way(parts: int = 1, sm_share: float = 0.0, sm_blocks: int = 0) -> float:
    """Seconds (best of --repeat) for GPU 0 to move nbytes into GPU 1: `parts` copies on as
    many streams, and `sm_share` of the bytes stored by a kernel of `sm_blocks` blocks (every
    SM's worth if 0) at the same time."""
    sm_bytes = int(nbytes * sm_share) // 4096 * 4096
    ce_bytes = nbytes - sm_bytes
    best = float("inf")
    with cupy.cuda.Device(0):
        for _ in range(args.repeat + 1):
            runtime.deviceSynchronize()
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            begin.record(sides[0])
            for s in sides[1:]:
                s.wait_event(begin)
            if sm_bytes:
                _copy((sm_blocks or 2 * _sms,), (512,),
                      (dst[0, 1].data.ptr + ce_bytes, src[0].data.ptr + ce_bytes,
                       cupy.uint64(sm_bytes // 16)), stream=sides[3])
            if parts:
                per = ce_bytes // parts // 4096 * 4096
                for i in range(parts):
                    size = per if i < parts - 1 else ce_bytes - per * (parts - 1)
                    runtime.memcpyPeerAsync(dst[0, 1].data.ptr + i * per, 1,
                                            src[0].data.ptr + i * per, 0, size,
                                            sides[i % 3].ptr)
            for s in sides[1:]:
                done = cupy.cuda.Event(disable_timing=True)
                done.record(s)
                sides[0].wait_event(done)
            end.record(sides[0])
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(begin, end) / 1e3)
    return best


def timed(pairs: list[tuple[int, int]], pull: bool = False) -> float:
    """Seconds for every copy of `pairs` to finish, all queued together (best of --repeat): each
    copy is cudaMemcpyPeerAsync on a stream of its own on the source GPU (on the destination
    GPU with `pull`)."""
    best = float("inf")
    for _ in range(args.repeat + 1):          # the first round warms up
        for d in range(n):
            with cupy.cuda.Device(d):
                runtime.deviceSynchronize()
        marks = {}
        for a, b in pairs:
            stream = pulls[a, b] if pull else streams[a, b]
            with cupy.cuda.Device(b if pull else a):
                begin, end = cupy.cuda.Event(), cupy.cuda.Event()
                begin.record(stream)
                runtime.memcpyPeerAsync(dst[a, b].data.ptr, b, src[a].data.ptr, a, nbytes,
                                        stream.ptr)
                end.record(stream)
                marks[a, b] = (begin, end)
        for d in range(n):
            with cupy.cuda.Device(d):
                runtime.deviceSynchronize()
        # queued within microseconds of each other; the longest copy bounds them all
        took = max(cupy.cuda.get_elapsed_time(b0, b1) for b0, b1 in marks.values()) / 1e3
        best = min(best, took)
    return best


rows = [("one way (0 -> 1)", [(0, 1)], 1),
        ("both ways (0 <-> 1), per direction", [(0, 1), (1, 0)], 1),
        ("pulled one way (1 reads 0)", [(0, 1)], 1, True),
        ("pulled both ways, per direction", [(0, 1), (1, 0)], 1, True)]
if n > 2:
    rows.append((f"fan out (0 -> {n - 1} others), GPU 0 egress", [(0, b) for b in range(1, n)],
                 n - 1))
    rows.append((f"all pairs ({n} GPUs), per GPU egress", pairs_all, n - 1))
print(f"{n} GPUs: {runtime.getDeviceProperties(0)['name'].decode()}; {args.mib} MiB per copy, "
      f"copy engines (cudaMemcpyPeerAsync, peer access on), best of {args.repeat}")
for label, pairs, per_gpu, *pull in rows:
    seconds = timed(pairs, bool(pull))
    print(f"  {label:<44} {nbytes * per_gpu / seconds / 1e9:8.1f} GB/s", flush=True)
for label, kwargs in (("split over 2 streams (0 -> 1)", dict(parts=2)),
                      ("split over 3 streams (0 -> 1)", dict(parts=3)),
                      ("SM stores (0 -> 1)", dict(parts=0, sm_share=1.0)),
                      ("engines + SM 10% (0 -> 1)", dict(sm_share=0.10)),
                      ("engines + SM 20% (0 -> 1)", dict(sm_share=0.20)),
                      ("engines + SM 20%, 16 blocks (0 -> 1)", dict(sm_share=0.20, sm_blocks=16)),
                      ("engines + SM 30% (0 -> 1)", dict(sm_share=0.30))):
    seconds = one_way(**kwargs)
    print(f"  {label:<44} {nbytes / seconds / 1e9:8.1f} GB/s", flush=True)
