"""The libraries `anyccl bench` measures side by side: anyccl itself, torch.distributed,
torch's symmetric-memory all_reduce and mpi4py. Each adapter runs one op on the buffers it is
handed (torch views NumPy ones without a copy), so every library moves the same bytes; an op a
library lacks returns None."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..communicator import Communicator
from ..ops import ReduceOp

Runner = Callable[[], None]


class AnycclPeer:
    name = "anyccl"

    def __init__(self, comm: Communicator, device: str = "cpu") -> None:
        self.comm = comm

    def barrier(self) -> None:
        self.comm.barrier()

    def runner(self, op: str, b: dict[str, Any], redop: ReduceOp, root: int) -> Runner | None:
        c = self.comm
        table: dict[str, Runner] = {
            "all_reduce": lambda: c.all_reduce(b["buf"], redop),
            "reduce": lambda: c.reduce(b["buf"], root, redop),
            "broadcast": lambda: c.broadcast(b["buf"], root),
            "all_gather": lambda: c.all_gather(b["out"], b["inp"]),
            "gather": lambda: c.gather(b["inp"], b.get("outs"), root),
            "scatter": lambda: c.scatter(b["out"], b.get("chunks"), root),
            "reduce_scatter": lambda: c.reduce_scatter(b["out"], b["inp"], redop),
            "all_to_all": lambda: c.all_to_all(b["out"], b["inp"]),
            "sendrecv": lambda: c.sendrecv(b["inp"], (c.rank + 1) % c.size, b["out"],
                                           (c.rank - 1) % c.size),
        }
        return table[op]

    def close(self) -> None:
        pass


def _ring(irecv: Callable, send: Callable, rank: int, size: int, inp: Any, out: Any) -> None:
    """nccl-tests' sendrecv: receive from the left neighbour while sending to the right."""
    w = irecv(out, (rank - 1) % size)
    send(inp, (rank + 1) % size)
    w.wait()


class TorchPeer:
    """torch.distributed: gloo for host buffers, NCCL for GPU buffers (torch tensors already)."""

    name = "torch"

    def __init__(self, comm: Communicator, device: str = "cpu") -> None:
        import torch

        self.torch, self.dist = torch, _torch_group(comm, device)
        self.rank, self.size = comm.rank, comm.size

    def barrier(self) -> None:
        self.dist.barrier()

    def _t(self, a: Any) -> Any:
        if isinstance(a, list):
            return [self._t(x) for x in a]
        if isinstance(a, self.torch.Tensor):
            return a
        if a.dtype.name == "bfloat16":
            return self.torch.from_numpy(a.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(a)

    def runner(self, op: str, b: dict[str, Any], redop: ReduceOp, root: int) -> Runner | None:
        d = self.dist
        ops = {ReduceOp.SUM: d.ReduceOp.SUM, ReduceOp.MAX: d.ReduceOp.MAX,
               ReduceOp.MIN: d.ReduceOp.MIN, ReduceOp.PROD: d.ReduceOp.PRODUCT,
               ReduceOp.BAND: d.ReduceOp.BAND, ReduceOp.BOR: d.ReduceOp.BOR,
               ReduceOp.BXOR: d.ReduceOp.BXOR}
        top = ops.get(redop)
        t = {k: self._t(v) for k, v in b.items() if v is not None and k not in ("kind", "_roots")}
        rank = self.rank
        if top is None and op in ("all_reduce", "reduce", "reduce_scatter"):
            return None
        if op == "all_to_all" and b.get("kind") == "in":
            return None  # gloo's all_to_all_single gives wrong data when output is input
        table: dict[str, Runner] = {
            "all_reduce": lambda: d.all_reduce(t["buf"], top),
            "reduce": lambda: d.reduce(t["buf"], root, top),
            "broadcast": lambda: d.broadcast(t["buf"], root),
            "all_gather": lambda: d.all_gather_into_tensor(t["out"], t["inp"]),
            "gather": lambda: d.gather(t["inp"], t.get("outs"), root),
            "scatter": lambda: d.scatter(t["out"], t.get("chunks"), root),
            "reduce_scatter": lambda: d.reduce_scatter_tensor(t["out"], t["inp"], top),
            "all_to_all": lambda: d.all_to_all_single(t["out"], t["inp"]),
            "sendrecv": lambda: _ring(d.irecv, d.send, rank, self.size, t["inp"], t["out"]),
        }
        return table[op]

    def close(self) -> None:
        if self.dist.is_initialized():  # torch and symm share one process group
            self.dist.destroy_process_group()


def _torch_group(comm: Communicator, device: str) -> Any:
    """torch.distributed with its default process group over `comm`'s ranks (gloo on the
    host, NCCL on GPUs), made once for the torch peers of one run; the module."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    if dist.is_initialized():
        return dist
    address = None
    if comm.rank == 0:
        import socket

        from ..netaddr import reachable_address

        # across hosts: where the others reach rank 0 (as anyccl's own rendezvous)
        host = reachable_address() if len(set(comm.hosts)) > 1 else "127.0.0.1"
        with socket.socket() as s:
            s.bind((host, 0))
            address = f"tcp://{host}:{s.getsockname()[1]}"
    address = comm.broadcast_object(address, 0)
    if device == "cpu":
        dist.init_process_group("gloo", init_method=address, rank=comm.rank,
                                world_size=comm.size)
    else:
        dist.init_process_group("nccl", init_method=address, rank=comm.rank,
                                world_size=comm.size, device_id=torch.device(device))
    return dist


class GlooPeer(TorchPeer):
    """torch.distributed's gloo by name: the torch peer on host arrays."""

    name = "gloo"


class SymmPeer(TorchPeer):
    """torch's symmetric-memory all_reduce, the fastest small all_reduce inside torch:
    `torch.ops.symm_mem.two_shot_all_reduce_` in place, on buffers that `anyccl bench`
    allocates with `torch.distributed._symmetric_memory.empty` for every library of the run
    when this peer takes part (`symmetric`), each registered by `rendezvous` on first use.
    SUM on float32 and bfloat16 only; never captured into CUDA graphs; NVLink multicast is
    not used (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before torch creates any)."""

    name = "torch-symm"
    symmetric = True
    captures = False

    def __init__(self, comm: Communicator, device: str = "cpu") -> None:
        if device == "cpu":
            raise RuntimeError("--compare symm measures GPU buffers: add --device cuda")
        import os

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        super().__init__(comm, device)
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.group = self.dist.group.WORLD.group_name

    def runner(self, op: str, b: dict[str, Any], redop: ReduceOp, root: int) -> Runner | None:
        torch = self.torch
        t = b.get("buf")
        if op != "all_reduce" or redop is not ReduceOp.SUM or t is None or \
                t.dtype not in (torch.float32, torch.bfloat16):
            return None
        self.symm_mem.rendezvous(t, self.group)
        two_shot, group = torch.ops.symm_mem.two_shot_all_reduce_, self.group
        return lambda: two_shot(t, "sum", group)


class MPIPeer:
    """mpi4py's buffer interface, on whatever MPI it was built with."""

    name = "mpi"

    def __init__(self, comm: Communicator, device: str = "cpu") -> None:
        if device != "cpu":
            raise RuntimeError("--compare mpi measures host buffers; drop it with --device cuda")
        from mpi4py import MPI

        self.MPI, self.c = MPI, MPI.COMM_WORLD
        if self.c.Get_size() != comm.size:
            raise RuntimeError("--compare mpi needs the job started by mpiexec (anyccl bench -n N "
                               "does this when mpiexec is on PATH)")

    def barrier(self) -> None:
        self.c.Barrier()

    def runner(self, op: str, b: dict[str, Any], redop: ReduceOp, root: int) -> Runner | None:
        MPI, c = self.MPI, self.c
        if any(getattr(v, "dtype", np.dtype("f4")).name in ("bfloat16", "float16")
               for v in b.values() if v is not None and not isinstance(v, (list, str))):
            return None  # MPI has no standard type for these
        mop = {ReduceOp.SUM: MPI.SUM, ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN,
               ReduceOp.PROD: MPI.PROD, ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR,
               ReduceOp.BXOR: MPI.BXOR}.get(redop)
        if mop is None and op in ("all_reduce", "reduce", "reduce_scatter"):
            return None
        rank, size = c.Get_rank(), c.Get_size()
        in_place = b.get("kind") == "in"
        if in_place and op == "reduce_scatter":
            return None  # MPI puts an in-place result at the buffer's start, not at the rank's
        IN = MPI.IN_PLACE

        def reduce() -> None:
            if rank == root:
                c.Reduce(IN, b["buf"], mop, root)
            else:
                c.Reduce(b["buf"], None, mop, root)

        table: dict[str, Runner] = {
            "all_reduce": lambda: c.Allreduce(IN, b["buf"], mop),
            "reduce": reduce,
            "broadcast": lambda: c.Bcast(b["buf"], root),
            "all_gather": (lambda: c.Allgather(IN, b["out"])) if in_place else
            (lambda: c.Allgather(b["inp"], b["out"])),
            "gather": lambda: c.Gather(b["inp"], b.get("out_whole"), root),
            "scatter": lambda: c.Scatter(b.get("chunks_whole"), b["out"], root),
            "reduce_scatter": lambda: c.Reduce_scatter_block(b["inp"], b["out"], mop),
            "all_to_all": (lambda: c.Alltoall(IN, b["out"])) if in_place else
            (lambda: c.Alltoall(b["inp"], b["out"])),
            "sendrecv": lambda: c.Sendrecv(b["inp"], (rank + 1) % size, 0, b["out"],
                                           (rank - 1) % size, 0),
        }
        return table[op]

    def close(self) -> None:
        pass


class BackendPeer(AnycclPeer):
    """anyccl itself on another of its backends, beside the main communicator, so that two
    transports meet in one run (`anyccl bench --backend mpi --compare shm`; on GPUs
    `--backend auto --compare ipc,nccl,torch` puts the routing policy beside both routes)."""

    backend = "shm"
    name = "anyccl-shm"

    def __init__(self, comm: Communicator, device: str = "cpu") -> None:
        import anyccl

        super().__init__(anyccl.init(backend=self.backend), device)

    def close(self) -> None:
        self.comm.close()


def _on(backend: str) -> type[BackendPeer]:
    return type(f"{backend.capitalize()}Peer", (BackendPeer,),
                {"backend": backend, "name": f"anyccl-{backend}"})


# the module each peer needs, and the extra of anyccl's that brings it
NEEDS = {"torch": ("torch", "torch"), "gloo": ("torch", "torch"), "symm": ("torch", "torch"),
         "mpi": ("mpi4py", "mpi")}


def peers() -> dict[str, type]:
    """Every library `--compare` takes: torch (gloo on host arrays, NCCL on GPUs; `gloo` names
    the former), torch's symmetric memory, mpi (mpi4py), and anyccl on each registered backend
    but mpi (whose name is mpi4py's here)."""
    from ..backends import registry

    names = [*registry.host_backends(), *registry.selectable_gpu_backends()]
    return {"torch": TorchPeer, "gloo": GlooPeer, "symm": SymmPeer, "mpi": MPIPeer,
            **{b: _on(b) for b in names if b != "mpi"}}
