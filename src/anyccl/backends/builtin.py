"""anyccl's own backends, one registration each (see registry.py)."""

from __future__ import annotations

from . import hierarchical, mpi, nccl, shm, staging
from .ipc import backend as ipc
from .registry import GpuEntry, HostEntry, register_gpu, register_host

register_host(HostEntry("shm", "cpu", shm.create, shm.status))
register_host(HostEntry("mpi", "cpu (many nodes)", mpi.create, mpi.status,
                        gpu_arrays="mpi-staged"))
register_host(HostEntry("shm+gloo", "cpu (many nodes: shm inside, torch's gloo between)",
                        hierarchical.creator("gloo"), hierarchical.status("gloo")))
register_host(HostEntry("shm+mpi", "cpu (many nodes: shm inside, MPI between)",
                        hierarchical.creator("mpi"), hierarchical.status("mpi")))
register_gpu(GpuEntry("nccl", "cuda", nccl.create, nccl.status))
register_gpu(GpuEntry("ipc", "cuda (one node)", ipc.creator("ipc"), ipc.status))
register_gpu(GpuEntry("auto", "cuda (one node, measured)",
                      ipc.creator("auto"), ipc.status))
register_gpu(GpuEntry("mpi-staged", "cuda, on mpi", staging.create, staging.status,
                      selectable=False))
