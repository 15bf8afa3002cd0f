"""The mpi backend's GPU staging pipeline, run without a GPU: anyccl.gpu's CUDA calls are
replaced by host-memory equivalents (copies are memmoves, pinned memory is NumPy memory, events
are always complete), and "device arrays" are host arrays behind __cuda_array_interface__. What
runs for real: the chunking, the ring of pinned slots, the order of copies and MPI calls, and
MPI itself. Run by tests/test_mpi_staging.py under mpiexec; prints "<rank> <backend> OK".
"""

import ctypes
import os

import numpy as np

import anyccl
from anyccl import gpu

os.environ["ANYCCL_MPI_STAGING_CHUNK"] = "4096"  # many chunks, so the ring of slots turns
gpu.device_count = lambda: 1
gpu.set_device = gpu.use_device = lambda d: None
gpu.new_stream = lambda d: 11
gpu.new_event = lambda d: 22
gpu.destroy_event = gpu.destroy_stream = lambda x: None
gpu.record = lambda e, s: None
gpu.stream_wait = lambda s, e: None
gpu.event_done = lambda e: True
gpu.device_of_pointer = lambda p: 0
gpu._check = lambda result, call: result[1] if len(result) > 1 else None
pinned = {}


class HostRuntime:
    """The three runtime calls the staging uses, on host memory."""

    class cudaMemcpyKind:  # noqa: N801 - the CUDA name
        cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice = 2, 1

    @staticmethod
    def cudaMemcpyAsync(dst, src, nbytes, kind, stream):  # noqa: N802
        ctypes.memmove(dst, src, nbytes)
        return (0,)

    @staticmethod
    def cudaMallocHost(nbytes):  # noqa: N802
        buffer = np.empty(nbytes, np.uint8)
        pinned[buffer.ctypes.data] = buffer
        return 0, buffer.ctypes.data

    @staticmethod
    def cudaFreeHost(ptr):  # noqa: N802
        pinned.pop(ptr)
        return (0,)


gpu._rt = lambda: HostRuntime


class Device:
    """A host array presented as a GPU array."""

    def __init__(self, a):
        self.a = a

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "version": 3,
                "data": (self.a.ctypes.data, False), "strides": None, "stream": 1}


comm = anyccl.init(backend="mpi")
r, n = comm.rank, comm.size
ok = True
for count in (0, 1, 1000, 10_001, 100_003):
    i = np.arange(count)
    for dt in (np.float32, np.float64, np.int32):
        x = (i % 7 + r).astype(dt)
        comm.all_reduce(Device(x))
        ok &= np.array_equal(x, (i % 7 * n + n * (n - 1) // 2).astype(dt))
        y = (i % 5 + r).astype(dt)
        comm.broadcast(Device(y), n - 1)
        ok &= np.array_equal(y, (i % 5 + n - 1).astype(dt))
    z = i.astype(np.float32) + r
    out = np.zeros(count * n, np.float32)
    comm.all_gather(Device(out), Device(z))
    ok &= np.array_equal(out, np.concatenate([i.astype(np.float32) + q for q in range(n)]))
    whole = np.arange(count * n, dtype=np.float32)
    rs = np.zeros(count, np.float32)
    comm.reduce_scatter(Device(rs), Device(whole * (r + 1)), "avg")
    ok &= np.allclose(rs, whole[r * count:(r + 1) * count] * (n + 1) / 2)
    t = np.arange(count * n, dtype=np.int64) + 1000 * r
    comm.all_to_all(Device(t), Device(t))
    ok &= np.array_equal(t, np.concatenate([np.arange(count * n)[r * count:(r + 1) * count]
                                            + 1000 * q for q in range(n)]))
    red = np.full(count, r + 1.0)
    comm.reduce(Device(red), 0)
    ok &= np.array_equal(red, np.full(count, n * (n + 1) / 2 if r == 0 else r + 1.0))
work = comm.all_reduce(Device(np.ones(10)), async_op=True)
work.wait()
print(r, comm.backend, "OK" if ok else "WRONG", flush=True)
comm.close()
