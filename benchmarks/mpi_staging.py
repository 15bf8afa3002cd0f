"""GPU all_reduce over MPI without CUDA-aware MPI: anyccl's pipelined host staging against the
NVIDIA sample's approach (copy everything to the host, MPI_Allreduce, copy everything back), in
one run, on the same GPUs and MPI. Run under mpiexec, one rank per GPU:

    mpiexec -n 2 python benchmarks/mpi_staging.py [--mib 256] [--iters 10]

Prints a table (size, time, busbw of each, ratio) from rank 0; every result is checked.
"""

import argparse
import time

import torch
from mpi4py import MPI

import anyccl

parser = argparse.ArgumentParser()
parser.add_argument("--mib", type=int, nargs="+", default=[16, 64, 256])
parser.add_argument("--iters", type=int, default=10)
args = parser.parse_args()

rank_in_world = MPI.COMM_WORLD.Get_rank()
comm = anyccl.init(backend="mpi", device_id=rank_in_world % torch.cuda.device_count())
torch.cuda.set_device(comm.device)
world = MPI.COMM_WORLD
n = comm.size


def naive(x):
    host = x.cpu().numpy()                       # all of it to the host
    world.Allreduce(MPI.IN_PLACE, host, MPI.SUM)
    x.copy_(torch.from_numpy(host))              # all of it back
    torch.cuda.synchronize()


def staged(x):
    comm.all_reduce(x)
    torch.cuda.synchronize()


def timed(fn, x):
    fn(x)
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        fn(x)
    return world.allreduce((time.perf_counter() - t0) / args.iters, MPI.MAX)


if comm.rank == 0:
    print(f"# {n} ranks, MPI: {MPI.Get_library_version().splitlines()[0]}, GPUs: "
          f"{torch.cuda.get_device_name(comm.device)}; busbw = 2(n-1)/n * size / time")
    print(f"# {'size':>12} {'naive us':>10} {'GB/s':>7} {'staged us':>10} {'GB/s':>7} "
          f"{'ratio':>6} #wrong")
for mib in args.mib:
    count = mib * 2**20 // 4
    x = torch.full((count,), float(comm.rank + 1), device=f"cuda:{comm.device}")
    t_naive = timed(naive, x)
    x.fill_(float(comm.rank + 1))
    t_staged = timed(staged, x)
    check = torch.full((count,), float(comm.rank + 1), device=f"cuda:{comm.device}")
    comm.all_reduce(check)
    wrong = int((check != n * (n + 1) / 2).sum().item())
    wrong = world.allreduce(wrong)
    bus = 2 * (n - 1) / n * count * 4 / 1e9
    if comm.rank == 0:
        print(f"  {count * 4:>12} {t_naive * 1e6:>10.0f} {bus / t_naive:>7.2f} "
              f"{t_staged * 1e6:>10.0f} {bus / t_staged:>7.2f} {t_naive / t_staged:>6.2f} "
              f"{wrong}", flush=True)
comm.close()
