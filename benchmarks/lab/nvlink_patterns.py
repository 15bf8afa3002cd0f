"""What the GPUs' links carry when SM kernels write (push) or read (pull) peer memory, by
pattern: every GPU to its ring neighbour only, or to every other GPU at once; and what the
copy engines carry in the same patterns. One process drives every visible GPU (peer access on),
all GPUs at once; GB/s is the bytes each GPU sends (push, copy engines) or fetches (pull) over
the slowest GPU's time. A large all_reduce moves 2 (n - 1) / n of its size per GPU, so its
busbw is this rate: the figure tells whether a kernel is bound by the links or by itself.

    python benchmarks/lab/nvlink_patterns.py [--mib 256] [--blocks 32 64 128 132 264]
"""
from __future__ import annotations

import argparse
import itertools

import cupy as cp

SOURCE = r"""
typedef unsigned long long u64;
// chunk c of `bytes` (`chunk` bytes each) goes between `local` and peer c % npeer's buffer at
// the same offset; push: local -> peer, pull: peer -> local. 16-byte packs, 4 in flight.
extern "C" __global__ void move(char* local, char* const* peers, int npeer, u64 bytes,
                                u64 chunk, int pull) {
    const u64 chunks = bytes / chunk, packs = chunk / 16;
    for (u64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        char* remote = peers[c % npeer] + c * chunk;
        const uint4* s = (const uint4*)(pull ? remote : local + c * chunk);
        uint4* d = (uint4*)(pull ? local + c * chunk : remote);
        u64 i = threadIdx.x;
        for (; i + 3 * blockDim.x < packs; i += 4 * blockDim.x) {
            uint4 v0 = s[i], v1 = s[i + blockDim.x], v2 = s[i + 2 * blockDim.x],
                  v3 = s[i + 3 * blockDim.x];
            d[i] = v0; d[i + blockDim.x] = v1; d[i + 2 * blockDim.x] = v2;
            d[i + 3 * blockDim.x] = v3;
        }
        for (; i < packs; i += blockDim.x) d[i] = s[i];
    }
}
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256, help="bytes each GPU moves, MiB")
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128, 132, 264])
    p.add_argument("--threads", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--chunk-kib", type=int, nargs="+", default=[64, 256])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-sm", action="store_true", help="the copy engines only")
    args = p.parse_args()
    n = cp.cuda.runtime.getDeviceCount()
    assert n >= 2, "needs 2 GPUs or more"
    nbytes = args.mib << 20
    bufs, kernels, streams, ce_streams = [], [], [], []
    for d in range(n):
        with cp.cuda.Device(d):
            for e in range(n):
                if e != d:
                    cp.cuda.runtime.deviceEnablePeerAccess(e)
            bufs.append((cp.ones(nbytes, cp.uint8), cp.zeros(nbytes, cp.uint8)))
            kernels.append(cp.RawModule(code=SOURCE, options=("-std=c++17",)).get_function("move"))
            streams.append(cp.cuda.Stream(non_blocking=True))
            ce_streams.append([cp.cuda.Stream(non_blocking=True) for _ in range(n - 1)])

    def timed(launch) -> float:
        """GB/s per GPU over the slowest GPU (each launches `reps` times between two events)."""
        evs = []
        for d in range(n):
            with cp.cuda.Device(d):
                launch(d)  # warm
        for d in range(n):
            with cp.cuda.Device(d):
                cp.cuda.Device(d).synchronize()
        for d in range(n):
            with cp.cuda.Device(d):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(streams[d])
                for _ in range(args.reps):
                    launch(d)
                b.record(streams[d])
                evs.append((a, b))
        worst = 0.0
        for d in range(n):
            with cp.cuda.Device(d):
                evs[d][1].synchronize()
                worst = max(worst, cp.cuda.get_elapsed_time(*evs[d]) / args.reps)
        return nbytes / (worst * 1e-3) / 1e9

    patterns = {"ring": lambda d: [(d + 1) % n],
                "all": lambda d: [(d + i) % n for i in range(1, n)]}
    peer_arrays = {}
    for name, peers_of in patterns.items():
        for d in range(n):
            with cp.cuda.Device(d):
                peer_arrays[name, d] = cp.array([bufs[q][1].data.ptr for q in peers_of(d)],
                                                cp.uint64)
    print(f"# {n} GPUs, {args.mib} MiB per GPU, GB/s per GPU (slowest GPU), {args.reps} reps")
    print(f"{'mode':>5} {'pattern':>7} {'blocks':>6} {'threads':>7} {'chunk':>6} {'GB/s':>7}")
    for mode, name, blocks, threads, ck in itertools.product(
            ("push", "pull"), patterns, [] if args.no_sm else args.blocks, args.threads,
            args.chunk_kib):
        def launch(d: int, mode: str = mode, name: str = name, blocks: int = blocks,
                   threads: int = threads, ck: int = ck) -> None:
            with cp.cuda.Device(d):
                peers = peer_arrays[name, d]
                kernels[d]((blocks,), (threads,),
                           (bufs[d][0] if mode == "push" else bufs[d][1], peers,
                            cp.int32(len(peers)), cp.uint64(nbytes), cp.uint64(ck << 10),
                            cp.int32(mode == "pull")), stream=streams[d])
        print(f"{mode:>5} {name:>7} {blocks:>6} {threads:>7} {ck:>5}K {timed(launch):7.1f}",
              flush=True)
    def ce_copies(d: int, plan: list[tuple[int, int, bool, int]]) -> None:
        """Queue copies (peer, offset, pull, stream index) of `part` bytes each on device d's
        copy-engine streams, all forked from and joined to streams[d]."""
        start = cp.cuda.Event(disable_timing=True)
        start.record(streams[d])
        used = sorted({s for _, _, _, s in plan})
        for s in used:
            ce_streams[d][s].wait_event(start)
        part = nbytes // len(plan)
        for k, (q, offset, pull, s) in enumerate(plan):
            mine, theirs = bufs[d][0].data.ptr + k * part, bufs[q][1].data.ptr + offset
            if pull:
                cp.cuda.runtime.memcpyPeerAsync(mine, d, theirs, q, part, ce_streams[d][s].ptr)
            else:
                cp.cuda.runtime.memcpyPeerAsync(theirs, q, mine, d, part, ce_streams[d][s].ptr)
        for s in used:
            done = cp.cuda.Event(disable_timing=True)
            done.record(ce_streams[d][s])
            streams[d].wait_event(done)

    others = range(1, n)
    part_of = nbytes // (n - 1)
    ce_modes = {   # copy engines: every GPU moves nbytes in all, in these shapes
        "ce ring": lambda d: [((d + 1) % n, 0, False, 0)],
        "ce all at once": lambda d: [((d + i) % n, (i - 1) * part_of, False, i - 1)
                                     for i in others],
        "ce push peer by peer": lambda d: [((d + i) % n, (i - 1) * part_of, False, 0)
                                           for i in others],
        "ce pull peer by peer": lambda d: [((d + i) % n, (i - 1) * part_of, True, 0)
                                           for i in others],
        "ce push+pull, 2 streams": lambda d: [
            ((d + i) % n, (i - 1) * part_of // 2, pull, int(pull))
            for i in others for pull in (False, True)],
        "ce push 4M chunks rotating": lambda d: [
            ((d + i) % n, ((i - 1) * 64 + c) * (4 << 20) % nbytes, False, 0)
            for c in range(max(1, nbytes // (4 << 20) // (n - 1))) for i in others],
    }
    for name, plan_of in ce_modes.items():
        print(f"{name:>30} {timed(lambda d, f=plan_of: ce_copies(d, f(d))):7.1f}", flush=True)

if __name__ == "__main__":
    main()
