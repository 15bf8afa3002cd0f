"""Average "gradients" across ranks, as NVIDIA's multi-GPU sample does: each rank computes
local gradients g[i] = rank + 0.001 * i on its device (NumPy on the CPU; a CUDA kernel compiled
at run time with cuda.core on a GPU), then all_reduce(AVG) makes every rank hold the mean,
(world - 1) / 2 + 0.001 * i, which is checked element by element. Prints the timings.

    anyccl run -n 4 examples/gradient_average.py                       # CPU, shm
    mpiexec -n 4 python examples/gradient_average.py --backend mpi      # CPU, MPI
    anyccl run -n 2 examples/gradient_average.py --device cuda         # GPUs, nccl
"""

import argparse
import sys
import time

import numpy as np

import anyccl

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default=None, help="shm (default), mpi or nccl")
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
parser.add_argument("--size", type=int, default=1 << 22, help="gradient elements per rank")
parser.add_argument("--repeat", type=int, default=5)
args = parser.parse_args()

KERNEL = r"""
extern "C" __global__ void local_gradients(float* g, float rank, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) g[i] = rank + 0.001f * (float)i;
}
"""


def gpu_gradients(device: int, rank: int, n: int):
    """g on GPU `device`, computed by our own kernel (cuda.core: NVRTC + launch)."""
    import torch

    try:
        from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
    except ImportError:  # cuda.core before 1.0
        from cuda.core.experimental import Device, LaunchConfig, Program, ProgramOptions, launch
    dev = Device(device)
    dev.set_current()
    program = Program(KERNEL, code_type="c++",
                      options=ProgramOptions(std="c++17", arch=f"sm_{dev.arch}"))
    kernel = program.compile("cubin").get_kernel("local_gradients")
    g = torch.empty(n, dtype=torch.float32, device=f"cuda:{device}")
    stream = dev.create_stream()
    launch(stream, LaunchConfig(grid=(n + 255) // 256, block=256), kernel,
           g.data_ptr(), np.float32(rank), np.uint64(n))
    stream.sync()
    return g


if args.device == "cuda":
    import torch

    comm = anyccl.init(args.backend or "nccl")
    make = lambda: gpu_gradients(comm.device, comm.rank, args.size)  # noqa: E731
    finish = torch.cuda.synchronize       # the all_reduce is queued on the stream: wait for it
    host = lambda g: g.cpu().numpy()  # noqa: E731
else:
    comm = anyccl.init(args.backend)
    make = lambda: (comm.rank + 0.001 * np.arange(args.size)).astype(np.float32)  # noqa: E731
    finish = lambda: None  # noqa: E731
    host = np.asarray

expected = ((comm.size - 1) / 2 + 0.001 * np.arange(args.size)).astype(np.float64)
times, worst = [], 0.0
for _ in range(args.repeat):
    g = make()
    comm.barrier()
    t0 = time.perf_counter()
    comm.all_reduce(g, op="avg")
    finish()
    times.append(time.perf_counter() - t0)
    result = host(g)
    worst = max(worst, float(np.max(np.abs(result - expected) / np.maximum(1, expected))))
ok = worst < 1e-5
best = min(times)
print(f"rank {comm.rank}: {args.size} float32 gradients averaged over {comm.size} ranks "
      f"({comm.backend}, {args.device}) in {best * 1e3:.2f} ms (best of {args.repeat}, "
      f"{4 * args.size / best / 1e9:.2f} GB/s of gradient); max relative error {worst:.1e}: "
      f"{'OK' if ok else 'WRONG'}", flush=True)
comm.close()
sys.exit(0 if ok else 1)
