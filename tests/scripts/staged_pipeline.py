"""The mpi backend's GPU staging pipeline, run without a GPU: anyccl.gpu's CUDA calls go to
tests/fake_gpu.py's simulated device, whose streams are threads that run their work in order
and delay every copy at random, so a copy the pipeline does not order by events (before MPI
reads a pinned chunk, or before a slot is reused) shows up as a wrong result. What runs for
real: the chunking, the ring of pinned slots, the events between the two copy streams and MPI,
and MPI itself. Run by tests/test_mpi_staging.py under mpiexec; prints "<rank> <backend> OK".
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fake_gpu import FakeGpuArray as Device  # noqa: E402
from fake_gpu import install, launch  # noqa: E402

import anyccl  # noqa: E402

os.environ["ANYCCL_MPI_STAGING_CHUNK"] = "4096"  # many chunks, so the ring of slots turns
device = install()


def landed() -> bool:
    """Wait for the default stream (the results land there), as a program synchronises before
    reading GPU results on the host."""
    device.synchronize_stream(0)
    return True


comm = anyccl.init(backend="mpi")
r, n = comm.rank, comm.size
ok = True
for count in (0, 1, 1000, 10_001, 100_003):
    i = np.arange(count)
    for dt in (np.float32, np.float64, np.int32):
        x = (i % 7 + r).astype(dt)
        comm.all_reduce(Device(x))
        ok &= landed() and np.array_equal(x, (i % 7 * n + n * (n - 1) // 2).astype(dt))
        y = (i % 5 + r).astype(dt)
        comm.broadcast(Device(y), n - 1)
        ok &= landed() and np.array_equal(y, (i % 5 + n - 1).astype(dt))
    z = i.astype(np.float32) + r
    out = np.zeros(count * n, np.float32)
    comm.all_gather(Device(out), Device(z))
    gathered = np.concatenate([i.astype(np.float32) + q for q in range(n)])
    ok &= landed() and np.array_equal(out, gathered)
    whole = np.arange(count * n, dtype=np.float32)
    rs = np.zeros(count, np.float32)
    comm.reduce_scatter(Device(rs), Device(whole * (r + 1)), "avg")
    ok &= landed() and np.allclose(rs, whole[r * count:(r + 1) * count] * (n + 1) / 2)
    t = np.arange(count * n, dtype=np.int64) + 1000 * r
    comm.all_to_all(Device(t), Device(t))
    mine = np.arange(count * n)[r * count:(r + 1) * count]
    ok &= landed() and np.array_equal(t, np.concatenate([mine + 1000 * q for q in range(n)]))
    red = np.full(count, r + 1.0)
    comm.reduce(Device(red), 0)
    ok &= landed() and np.array_equal(red, np.full(count, n * (n + 1) / 2 if r == 0 else r + 1.0))
# an input still being written by a kernel on the caller's stream when the call is made
late = np.zeros(50_000)
launch(device, 0, lambda: late.__setitem__(slice(None), r + 1.0))
comm.all_reduce(Device(late))
ok &= landed() and np.array_equal(late, np.full(late.size, n * (n + 1) / 2))
work = comm.all_reduce(Device(np.ones(10)), async_op=True)
work.wait()
print(r, comm.backend, "OK" if ok else "WRONG", flush=True)
comm.close()
