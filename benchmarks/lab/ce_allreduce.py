"""An experiment: how fast could a two-GPU all_reduce go if the copy engines moved
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

    python3 benchmarks/lab/ce_allreduce.py [--mib 256 1024] [--chunks 1 4 16 64] [--repeat 5]
                                       [--back push pull] [--sync events memops spin kernel kwait]

--sync memops signals between the GPUs as anyccl's ce.py does between processes: the producing
stream writes a flag into the other GPU's memory (cuStreamWriteValue32) and the consuming
stream waits for it (cuStreamWaitValue32), instead of waiting on the producer's CUDA event:
the difference is what those flags cost. --sync spin writes the flag the same way but waits
for it in a one-thread kernel that spins on it (as the SM kernels wait); --sync kernel also
raises it from a one-thread kernel (a volatile store and a system fence) instead of a stream
memory operation; --sync kwait raises it from the kernel and waits for it by a stream memory
operation: which half of a stream-memop flag is slow.
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
parser.add_argument("--sync", nargs="+", default=["events"],
                    choices=["events", "memops", "spin", "kernel", "kwait"],
                    help="how one GPU's stream waits for the other's: CUDA events, flags by "
                         "stream memory operations, a memop write waited on by a spinning "
                         "kernel, a kernel's write waited on by a spinning kernel or by a "
                         "stream memory operation")
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
_FLAGS = r"""
extern "C" __global__ void spin(volatile unsigned int* flag, unsigned int value) {
    while (*flag < value) __nanosleep(64);
}
extern "C" __global__ void raise_flag(volatile unsigned int* flag, unsigned int value) {
    __threadfence_system();
    *flag = value;
    __threadfence_system();
}"""
_kernels: dict = {}


def _flag_kernel(name: str, device: int):
    """The flag kernel `name` compiled for GPU `device` (a module per device)."""
    if (name, device) not in _kernels:
        with cupy.cuda.Device(device):
            _kernels[name, device] = cupy.RawKernel(_FLAGS, name)
    return _kernels[name, device]


def _driver():
    from cuda.bindings import driver

    return driver


class Signal:
    """`stream` (on GPU `src`) lets `waiter` (on GPU `dst`) go on: by an event, or by a flag
    in GPU dst's memory written by one stream memory operation and waited on by another."""

    def __init__(self, sync: str, flags: list, epoch: int) -> None:
        self.sync, self.flags, self.epoch, self.used = sync, flags, epoch, 0

    def __call__(self, src: int, stream, dst: int, waiter) -> None:
        if self.sync == "events":
            with cupy.cuda.Device(src):
                event = cupy.cuda.Event(disable_timing=True)
                event.record(stream)
            with cupy.cuda.Device(dst):
                waiter.wait_event(event)
            return
        address = self.flags[dst].data.ptr + 4 * self.used    # a flag of its own per signal
        self.used += 1
        driver = _driver()
        with cupy.cuda.Device(src):
            if self.sync in ("kernel", "kwait"):
                _flag_kernel("raise_flag", src)((1,), (1,), (address, cupy.uint32(self.epoch)),
                                                stream=stream)
            else:
                driver.cuStreamWriteValue32(stream.ptr, address, self.epoch, 0)
        with cupy.cuda.Device(dst):
            if self.sync in ("memops", "kwait"):
                driver.cuStreamWaitValue32(waiter.ptr, address, self.epoch, 0)
            else:
                _flag_kernel("spin", dst)((1,), (1,), (address, cupy.uint32(self.epoch)),
                                          stream=waiter)


def run(mib: int, chunks: int, back: str, sync: str = "events") -> tuple[float, bool]:
    """(best seconds of --repeat, result correct) for an all_reduce of `mib` MiB of float32."""
    n = (mib << 20) // 4
    half = n // 2
    per = half // chunks
    x, scratch, copy_s, add_s, back_s, flags = [], [], [], [], [], []
    for g in range(2):
        with cupy.cuda.Device(g):
            flags.append(cupy.zeros(4 * chunks, dtype=cupy.uint32))
            x.append(cupy.empty(n, dtype=cupy.float32))
            scratch.append(cupy.empty(half, dtype=cupy.float32))
            copy_s.append(cupy.cuda.Stream(non_blocking=True))
            add_s.append(cupy.cuda.Stream(non_blocking=True))
            back_s.append(cupy.cuda.Stream(non_blocking=True))
    best = float("inf")
    for epoch in range(1, args.repeat + 2):
        signal = Signal(sync, flags, epoch)   # flags only grow: epoch e waits for >= e
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
                signal(g, copy_s[g], p, add_s[p])
                with cupy.cuda.Device(p):            # 2: the peer reduces that chunk
                    with add_s[p]:
                        mine = x[p][lo:lo + per]
                        mine += scratch[p][k * per:(k + 1) * per]
                returner = p if back == "push" else g   # 3: the chunk goes back to g
                if returner == p:                    # same GPU: an event
                    Signal("events", flags, epoch)(p, add_s[p], p, back_s[p])
                else:
                    signal(p, add_s[p], g, back_s[g])
                with cupy.cuda.Device(returner):
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
    for chunks, back, sync in ((c, b, y) for c in args.chunks for b in args.back
                               for y in args.sync):
        seconds, ok = run(mib, chunks, back, sync)
        print(f"  {mib:5d} MiB  {chunks:3d} chunks  back by {back:<4}  sync {sync:<7}  "
              f"{seconds * 1e6:9.1f} us  "
              f"{(mib << 20) / seconds / 1e9:7.1f} GB/s  {'ok' if ok else 'WRONG'}", flush=True)
