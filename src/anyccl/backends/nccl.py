"""The `nccl` backend: GPU arrays moved and reduced by NCCL, ordered on CUDA streams.

Over NVIDIA's nccl4py (``pip install 'anyccl[gpu]'``): `nccl.core` creates, splits and aborts the
NCCL communicator; the collectives go through its thin `nccl.bindings` layer with raw pointers,
which keeps the cost of a call near that of the C API.

Operations are ordered on CUDA streams by a `GpuQueue` (gpu_queue.py), whose watchdog also asks
NCCL for asynchronous errors and, on a deadline, an error or a peer that died, aborts the NCCL
communicator (so no kernel stays stuck and a host blocked on the stream wakes up); the next
call on this communicator raises the error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import gpu
from ..buffers import BFLOAT16, GpuArray, Pieces, overlaps
from ..errors import AnycclError, UnsupportedError
from ..ops import ReduceOp, dtype_kind
from ..store import Store
from ..trace import OpRecord
from .gpu_base import QueuedGpuBackend
from .gpu_queue import Enqueue, GpuQueue, LostPeer
from .registry import GpuContext


def _nccl() -> tuple[Any, Any]:
    try:
        import nccl.bindings.nccl as bindings
        import nccl.core as core
    except ImportError as exc:
        raise UnsupportedError(
            f"the nccl backend needs nccl4py and an NCCL runtime: pip install 'anyccl[gpu]' "
            f"({exc})") from None
    return core, bindings


_ENTRY_POINTS: dict[str, int] = {}


def _entry_point(name: str) -> int | None:
    """The address of NCCL's function `"nccl" + name` in the library nccl4py loaded (known once
    a communicator exists), or None where nccl4py does not say it."""
    found = _ENTRY_POINTS.get(name)
    if found is None:
        try:
            from nccl.bindings._internal import nccl as loaded
            found = int(loaded._inspect_function_pointer(f"__nccl{name}"))
        except Exception:  # noqa: BLE001 - another nccl4py: its bindings serve the call
            return None
        if not found:
            return None
        _ENTRY_POINTS[name] = found
    return found


# NCCL's ncclDataType_t and ncclRedOp_t values (nccl.h)
_NCCL_TYPES: dict[np.dtype, int] = {
    np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2, np.dtype(np.uint32): 3,
    np.dtype(np.int64): 4, np.dtype(np.uint64): 5, np.dtype(np.float16): 6,
    np.dtype(np.float32): 7, np.dtype(np.float64): 8, BFLOAT16: 9,
}
_UINT8 = 1
_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3,
             ReduceOp.AVG: 4}
# bool arrays travel as uint8 0/1: or is max, and is min
_BOOL_OPS = {ReduceOp.SUM: 2, ReduceOp.MAX: 2, ReduceOp.BOR: 2,
             ReduceOp.PROD: 3, ReduceOp.MIN: 3, ReduceOp.BAND: 3}


def data_view(x: GpuArray) -> tuple[int, int]:
    """(count, NCCL dtype) that moves `x`'s bytes unchanged (any dtype: as bytes if need be)."""
    code = _NCCL_TYPES.get(x.dtype)
    return (x.size, code) if code is not None else (x.nbytes, _UINT8)


def reduction_view(x: GpuArray, op: ReduceOp, size: int) -> tuple[int, int, int]:
    """(count, NCCL dtype, NCCL op) that reduces `x` with `op` over `size` ranks;
    UnsupportedError if NCCL can't."""
    kind = dtype_kind(x.dtype)
    if op is ReduceOp.AVG and size == 1:
        # the mean of one value is the value; NCCL 2.28's one-rank reduce_scatter with ncclAvg
        # left the last elements of odd counts unwritten (seen on H200, float32 x 1048579)
        op = ReduceOp.SUM
    if kind == "b" and op in _BOOL_OPS:
        return x.size, _UINT8, _BOOL_OPS[op]
    if kind == "c" and op in (ReduceOp.SUM, ReduceOp.AVG):  # component-wise: as real pairs
        real = np.dtype(np.float32 if x.dtype == np.complex64 else np.float64)
        return 2 * x.size, _NCCL_TYPES[real], _NCCL_OPS[op]
    code = _NCCL_TYPES.get(x.dtype)
    if code is None or op not in _NCCL_OPS:
        raise UnsupportedError(
            f"the nccl backend cannot reduce {x.dtype.name} arrays with ReduceOp.{op.name} (NCCL "
            f"reduces int8/32/64, uint8/32/64, float16/32/64 and bfloat16 with SUM, PROD, MIN, "
            f"MAX, AVG; bool with SUM/MAX/BOR, PROD/MIN/BAND; complex with SUM/AVG); use a wider "
            f"dtype or a host array")
    return x.size, code, _NCCL_OPS[op]


class NcclBackend(QueuedGpuBackend):
    """One NCCL communicator on one GPU, queued through a `GpuQueue`."""

    name = "nccl"

    def __init__(self, comm: Any, rank: int, size: int, device: int, label: str,
                 lost_peer: LostPeer, timeout_s: float) -> None:
        core, self._b = _nccl()
        self._core_comm = comm
        self._comm = comm._comm  # the bindings' handle that nccl.core itself passes to NCCL
        self.rank, self.size, self.device = rank, size, device
        self._label = label
        self._lost_peer = lost_peer
        self.timeout_s = timeout_s                 # splits inherit it
        self.queue = GpuQueue(device, label, lost_peer, rank=rank, what="NCCL communicator",
                              enqueue_errors=(self._b.NCCLError,),
                              describe_error=self._error)
        self.queue.watch(health=self._health, abort=self._core_comm.abort)

    # ---- creation ----------------------------------------------------------------------------
    @classmethod
    def create(cls, store: Store, key: str, rank: int, size: int, device: int, label: str,
               timeout_s: float, lost_peer: LostPeer) -> NcclBackend:
        """Collective over the `size` ranks: rank 0 makes NCCL's unique id and shares it through
        `store` under `key`; every rank then joins the NCCL communicator on `device`."""
        core, _ = _nccl()
        gpu.set_device(device)
        if rank == 0:
            store.set(key, bytes(core.get_unique_id()))
        unique_id = core.UniqueId.from_bytes(store.get(key, timeout_s))
        comm = core.Communicator.init(size, rank, unique_id)
        return cls(comm, rank, size, device, label, lost_peer, timeout_s)

    def split(self, color: int | None, key: int, label: str, store: Any = None,
              group: str = "") -> NcclBackend | None:
        """Collective over this communicator (ncclCommSplit): None where color is None."""
        self.raise_if_failed()
        gpu.set_device(self.device)
        with self.queue.lock:
            child = self._core_comm.split(color, key)
        if color is None:
            return None
        return NcclBackend(child, child.rank, child.nranks, self.device, label, self._lost_peer,
                           self.timeout_s)

    def group(self, calls: list[Enqueue]) -> Enqueue:
        """One enqueue function running `calls` inside an NCCL group (fused, deadlock-free)."""
        def enqueue(stream: int) -> None:
            self._b.group_start()
            try:
                for call in calls:
                    call(stream)
            finally:
                self._b.group_end()
        return enqueue

    def _error(self, record: OpRecord, exc: BaseException) -> AnycclError:
        detail = ""
        try:
            detail = self._b.get_last_error(self._comm)
        except Exception:  # noqa: BLE001 - the detail is a courtesy
            pass
        return AnycclError(f"rank {self.rank}: {record}: NCCL refused the call: {exc}"
                           + (f" ({detail})" if detail else ""))

    def _health(self, record: OpRecord) -> BaseException | None:
        status = self._b.comm_get_async_error(self._comm)
        if status not in (self._b.Result.Success, self._b.Result.InProgress):
            return AnycclError(f"rank {self.rank}: NCCL reported {status!r} during {record}: "
                               f"{self._b.get_last_error(self._comm)}; the NCCL communicator was "
                               f"aborted")
        return None

    # enqueue functions: each takes the stream and issues NCCL calls on it
    def _one(self, name: str, args: tuple[int, int, int, int, int | None],
             fallback: Enqueue) -> Enqueue:
        """NCCL collective `name` (ncclAllReduce's name without "nccl") with `args` (send, recv,
        count, datatype, the op or root or None): a `gpu.NcclCall`, which a replay queues in
        one compiled call, where NCCL's entry point is known; else `fallback`, the same call
        through the bindings."""
        function = _entry_point(name)
        if function is None:
            return fallback
        return gpu.NcclCall(function, (*args, int(self._comm)), fallback, self._b.check_status)

    def all_reduce(self, x: GpuArray, op: ReduceOp) -> Enqueue:
        count, dtype, nop = reduction_view(x, op, self.size)
        return self._one("AllReduce", (x.ptr, x.ptr, count, dtype, nop),
                         lambda s: self._b.all_reduce(x.ptr, x.ptr, count, dtype, nop,
                                                      self._comm, s))

    def reduce(self, x: GpuArray, root: int, op: ReduceOp) -> Enqueue:
        count, dtype, nop = reduction_view(x, op, self.size)
        return lambda s: self._b.reduce(x.ptr, x.ptr, count, dtype, nop, root, self._comm, s)

    def broadcast(self, x: GpuArray, root: int) -> Enqueue:
        count, dtype = data_view(x)
        return self._one("Broadcast", (x.ptr, x.ptr, count, dtype, root),
                         lambda s: self._b.broadcast(x.ptr, x.ptr, count, dtype, root,
                                                     self._comm, s))

    def all_gather(self, outs: list[GpuArray], x: GpuArray) -> Enqueue:
        if _consecutive(outs):
            count, dtype = data_view(x)
            return self._one("AllGather", (x.ptr, outs[0].ptr, count, dtype, None),
                             lambda s: self._b.all_gather(x.ptr, outs[0].ptr, count, dtype,
                                                          self._comm, s))
        return self.exchange(sends=[x] * self.size, recvs=outs)

    def reduce_scatter(self, out: GpuArray, inputs: list[GpuArray],
                       op: ReduceOp) -> Enqueue:
        count, dtype, nop = reduction_view(out, op, self.size)
        if _consecutive(inputs):
            return self._one("ReduceScatter", (inputs[0].ptr, out.ptr, count, dtype, nop),
                             lambda s: self._b.reduce_scatter(inputs[0].ptr, out.ptr, count,
                                                              dtype, nop, self._comm, s))

        def staged(s: int) -> None:  # separate pieces: gather them into one scratch array
            whole = _scratch_copy(inputs, s)
            try:
                self._b.reduce_scatter(whole, out.ptr, count, dtype, nop, self._comm, s)
            finally:
                gpu.free_async(whole, s)
        return staged

    def gather(self, x: GpuArray, outs: list[GpuArray] | None,
               root: int) -> Enqueue:
        if self.rank != root:
            return self.exchange(sends=[x if r == root else None for r in range(self.size)],
                                  recvs=[None] * self.size)
        assert outs is not None
        return self.exchange(sends=[x if r == root else None for r in range(self.size)],
                              recvs=outs)

    def scatter(self, out: GpuArray, chunks: list[GpuArray] | None,
                root: int) -> Enqueue:
        recvs: list[GpuArray | None] = [out if r == root else None for r in range(self.size)]
        if self.rank != root:
            return self.exchange(sends=[None] * self.size, recvs=recvs)
        assert chunks is not None
        return self.exchange(sends=chunks, recvs=recvs)

    def all_to_all(self, outs: list[GpuArray], inputs: list[GpuArray]) -> Enqueue:
        if not any(overlaps(o, i) for o in outs for i in inputs):
            return self.exchange(sends=inputs, recvs=outs)

        def staged(s: int) -> None:  # in place: send from a copy of the input
            whole = _scratch_copy(inputs, s)
            try:
                size = inputs[0].nbytes
                copies = [GpuArray(whole + r * size, piece.size, piece.dtype, piece.device, None,
                                   piece.kind, None) for r, piece in enumerate(inputs)]
                self.exchange(sends=copies, recvs=outs)(s)
            finally:
                gpu.free_async(whole, s)
        return staged

    exchanges_any_sizes = True

    def exchange(self, sends: list[GpuArray | None],
                 recvs: list[GpuArray | None]) -> Enqueue:
        """Send sends[r] to and receive recvs[r] from every rank r, as one NCCL group (pieces
        of any size: what torch's all_to_all_single with split sizes does). This rank's own
        piece goes to itself inside the group too, so NCCL moves it while the peers' pieces
        travel (a device copy queued before the group held the whole exchange back by the
        time of that copy: 6% at 1 GiB on 4 GPUs); pieces of two sizes are a device copy."""
        calls: list[Enqueue] = []
        for peer in range(self.size):
            out, src = recvs[peer], sends[peer]
            if peer == self.rank:
                if out is not None and src is not None and out.ptr != src.ptr and out.nbytes \
                        and out.nbytes != src.nbytes:
                    calls.append(_device_copy(out, src))
                    continue
                if out is None or src is None or out.ptr == src.ptr:
                    continue
            if src is not None and src.nbytes:
                count, dtype = data_view(src)
                calls.append(lambda s, p=src.ptr, c=count, d=dtype, r=peer:
                             self._b.send(p, c, d, r, self._comm, s))
            if out is not None and out.nbytes:
                count, dtype = data_view(out)
                calls.append(lambda s, p=out.ptr, c=count, d=dtype, r=peer:
                             self._b.recv(p, c, d, r, self._comm, s))
        return self.group(calls)

    def send(self, x: GpuArray, dst: int, tag: int = 0) -> Enqueue:
        """(NCCL has no tags: messages between two ranks match in issue order.)"""
        count, dtype = data_view(x)
        return lambda s: self._b.send(x.ptr, count, dtype, dst, self._comm, s)

    def recv(self, x: GpuArray, src: int, tag: int = 0) -> Enqueue:
        count, dtype = data_view(x)
        return lambda s: self._b.recv(x.ptr, count, dtype, src, self._comm, s)

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait (briefly) for queued work, then free the NCCL communicator, stream and events."""
        finished = self.queue.drain()
        self.queue.stop()   # no health check of the communicator while it is freed
        with self.queue.lock:
            if finished:
                self._core_comm.destroy()
            elif self.failure is None:
                self._core_comm.abort()
        self.queue.close()


def _consecutive(pieces: list[GpuArray]) -> bool:
    if isinstance(pieces, Pieces):
        return True  # the pieces of one array: consecutive by construction
    return all(b.ptr == a.ptr + a.nbytes for a, b in zip(pieces, pieces[1:]))


def _device_copy(dst: GpuArray, src: GpuArray) -> Enqueue:
    return lambda stream: gpu.copy_async(dst.ptr, src.ptr, src.nbytes, stream)


def _scratch_copy(pieces: list[GpuArray], stream: int) -> int:
    """Stream-ordered scratch memory holding `pieces` back to back (free with free_async)."""
    whole = gpu.malloc_async(sum(p.nbytes for p in pieces), stream)
    offset = 0
    for piece in pieces:
        if piece.nbytes:
            gpu.copy_async(whole + offset, piece.ptr, piece.nbytes, stream)
        offset += piece.nbytes
    return whole


def create(ctx: GpuContext) -> NcclBackend:
    """The NCCL communicator of the context's ranks, on its device."""
    gpu.set_device(ctx.device)
    ctx.meet()  # NCCL's own rendezvous has no deadline and cannot be aborted: meet first
    return NcclBackend.create(ctx.store, f"{ctx.key}/nccl-id", ctx.rank, ctx.size, ctx.device,
                              ctx.label, ctx.timeout_s, ctx.host.lost_peer)


def version() -> str | None:
    """"nccl4py X, NCCL Y" when both the bindings and the NCCL runtime load; else None."""
    try:
        import nccl.core

        found = nccl.core.get_version()
    except Exception:  # noqa: BLE001 - any failure to load means: not usable here
        return None
    if found.libnccl is None:
        return None
    return f"nccl4py {found.nccl4py}, NCCL {found.libnccl.version}"


def status() -> str:
    """What `anyccl info` says of the nccl backend here."""
    found = version()
    if found:
        return f"available ({found})"
    return "not usable: pip install 'anyccl[gpu]' (nccl4py and the NCCL runtime)" \
        if gpu.machine_has_gpu() else gpu.NO_GPU
