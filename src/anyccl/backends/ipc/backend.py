"""The `ipc` backend: GPU arrays moved and reduced by anyccl's own kernels over peer memory.

Within one node, every rank maps the others' buffers (CUDA IPC, `memory.py`), and the kernels in
`kernels/` push data into them and signal through flags, with no CPU in the loop once queued.
It serves all_reduce (data and flags in one word for small arrays, one shot -- every rank
pushes everything -- for medium, two shots -- reduce-scatter then all-gather -- for large, and
for the largest the copy engines move the data while a kernel only reduces: `ce.py`) and
reduce_scatter on float32/float16/bfloat16 (accumulated in float32) with SUM, AVG, MIN, MAX;
all_gather, broadcast and messages (send/recv, tags checked) on any dtype (reduce_scatter and
all_gather of large arrays on the copy engines' ring too). The rest (other
dtypes and ops; reduce, gather, scatter, all_to_all) runs on the NCCL communicator this
backend keeps beside its kernels; both queue through the same ordered stream machinery
(`NcclBackend.run`), so operations stay in issue order whichever runs them.

Routing is decided from what every rank agrees on (op, byte size, dtype, reduce op), never from
pointers, so all ranks of a collective always pick the same side: `policy="ipc"` sends every op
the kernels can do to them (all_reduce's algorithm by the tuning table's thresholds);
`policy="auto"` follows the routes measured on this machine's shape (`routes.py`: which
implementation is fastest at each size, NCCL where nothing was measured), the same table on
every rank.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Callable

import numpy as np

from ... import gpu, settings, tuning
from ...buffers import BFLOAT16, GpuArray, overlaps
from ...errors import AnycclError, UnsupportedError
from ...ops import ReduceOp
from ...store import Store
from ...trace import OpRecord
from ..gpu_base import QueuedGpuBackend
from ..nccl import NcclBackend
from ..registry import GpuContext
from . import ce, compiler
from .memory import STATUS_ERROR, THREADS, TILE_BYTES, KernelArgs, PeerMemory, describe_args
from .routes import NCCL, Routes, agreed

_TYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", BFLOAT16: "bfloat16"}
_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}
_TAG_BITS = 24  # the part of a tag a message carries (kernels.cu: meta_of)

POLICIES = ("ipc", "auto")


# all_reduce's algorithms of lines (data and flags together: primitives.cuh, all_reduce.cu)
_LINES = ("low_latency", "low_latency_two_shot")

class IpcBackend(QueuedGpuBackend):
    """anyccl's peer-memory kernels on one GPU per rank, with an NCCL communicator for the rest;
    both queue through the NCCL backend's `GpuQueue`, so operations stay in issue order."""

    def __init__(self, nccl: NcclBackend, memory: PeerMemory, policy: str,
                 routes: Routes | None = None) -> None:
        if policy not in POLICIES:
            raise UnsupportedError(f"ipc policy {policy!r} is unknown; expected one of "
                                   f"{', '.join(POLICIES)}")
        self.nccl = nccl
        self.queue = nccl.queue
        self.policy = policy
        self.rank, self.size, self.device = nccl.rank, nccl.size, nccl.device
        self.memory = memory
        self.layout = memory.layout
        self._kernels = compiler.kernels(self.device)
        self._args = describe_args(memory)
        self._params = (ctypes.c_void_p * 1)(ctypes.addressof(self._args))
        self._params_address = ctypes.addressof(self._params)
        # fewer blocks leave NVLink bandwidth unused (results: the blocks-per-kernel sweeps)
        self.max_blocks = settings.IPC_BLOCKS.get()
        # of which this many take what arrived (copy it out, reduce it) while the rest push
        self.takers = tuning.value("ipc.takers")
        # tiles down to this size for small arrays (a power of two, at most TILE_BYTES)
        self.tile_min = min(TILE_BYTES, 1 << (tuning.value("ipc.tile_min").bit_length() - 1))
        # the tuning table (tuning.py): all_reduce's lines of data and flags up to ll_bytes,
        # then in two shots up to ll2_bytes (3 ranks or more), one shot of tiles up to
        # one_shot_bytes, else two shots
        self.ll2_bytes = tuning.value("ipc.ll_two_shot_max") if self.size > 2 else 0
        # the one-shot lines push the array to n - 1 peers: where the two shots of lines can
        # take over (3 ranks or more), they stop where they push what 2 ranks push at ll_max
        ll_max = tuning.value("ipc.ll_max")
        if self.ll2_bytes:
            ll_max //= self.size - 1
        self.ll_bytes = min(ll_max, self.layout.slot_bytes // 2)
        self.one_shot_bytes = tuning.value("ipc.one_shot_max")
        # copy engines from ce_bytes up (where the layout has their area, and there are peers):
        # the size from which they beat the two-shot kernels in the recorded runs
        self.ce_bytes = tuning.value("ipc.ce_min")
        self.ce_chunks = tuning.value("ipc.ce_chunks")  # per segment
        # streams wait for the copy engines' flags by one-thread kernels; by stream memory
        # operations only in the experiment that measured both alike (lab/ce_modes.py)
        self.ce_memop_wait = False
        if not self.layout.ce_ring_bytes or self.size == 1:
            self.ce_bytes = 1 << 62
        # which implementation runs each op at each size: the measured table (auto), else the
        # kernels wherever they serve, all_reduce's algorithm by the thresholds above
        self.routes = routes or Routes.kernels(
            self.ll_bytes, self.one_shot_bytes, self.ce_bytes,
            "policy ipc: the kernels for every op they serve; all_reduce by the tuning table",
            ll_two_shot_max=self.ll2_bytes, ranks=self.size)
        self._ce = ce.CopyEngineRing(memory, self.device)
        self._side: list[tuple[int, int]] = []   # (stream, event) for batched messages
        self._fork = gpu.new_event(self.device)
        nccl.queue.watch(health=self._health, abort=memory.aborted,
                         alarm=(memory.status, STATUS_ERROR))

    @classmethod
    def create(cls, store: Store, key: str, rank: int, size: int, device: int, label: str,
               timeout_s: float, lost_peer: Callable[[], tuple[int, str] | None],
               policy: str = "ipc") -> IpcBackend | NcclBackend:
        """Collective over the `size` ranks of one node: the NCCL communicator, then the peer
        memory (exchanged through `store` under `key`), then the kernels. With policy "auto",
        ranks that cannot share memory (several nodes, over 8 ranks) get NCCL alone."""
        nccl = NcclBackend.create(store, f"{key}/nccl", rank, size, device, label, timeout_s,
                                  lost_peer)
        try:
            memory = PeerMemory(store, f"{key}/ipc", rank, size, device, timeout_s)
        except UnsupportedError:  # every rank sees the same reason
            if policy == "auto":
                return nccl
            nccl.close()
            raise
        except BaseException:
            nccl.close()
            raise
        try:
            return cls(nccl, memory, policy,
                       _measured(policy, store, key, rank, size, device, timeout_s))
        except BaseException:
            memory.close()
            nccl.close()
            raise

    @property
    def name(self) -> str:
        """"ipc" (every op the kernels serve runs on them) or "auto" (the measured routes)."""
        return self.policy

    # ---- the queue: NCCL's, with the kernels' status word as its alarm ---------------------------
    def _health(self, record: OpRecord) -> BaseException | None:
        code, peer, expected, got = self.memory.error()
        if not code:
            return None
        mask = (1 << 40) - 1
        return AnycclError(
            f"rank {self.rank}: {record}: the message from rank {peer} carries tag "
            f"{got >> 40} and {got & mask} bytes, but this receive expects tag {expected >> 40} "
            f"and {expected & mask} bytes (tags compared modulo 2**{_TAG_BITS}); messages "
            f"between two ranks match in the order they were sent; the communicator was aborted")

    # ---- routing ---------------------------------------------------------------------------------
    def _ipc(self, op: str, nbytes: int) -> bool:
        return self.routes.pick(op, nbytes) != NCCL

    def _tiling(self, nbytes: int) -> tuple[int, int, int]:
        """(blocks, tile, takers) for a kernel whose blocks share `nbytes`: the tile (bytes
        between two flags) small enough that every pushing block has one, at most the
        layout's; of the blocks, `takers` only take what arrives (kernels: Role), no more
        than there are tiles, and none when `max_blocks` leaves no block to push."""
        # the smallest tile that still leaves every tile of a slot a flag (a slot's flags
        # are sized for tiles of TILE_BYTES)
        least = self.tile_min
        while -(-nbytes // least) > self.layout.max_tiles:
            least *= 2
        takers = self.takers if 0 < self.takers < self.max_blocks else 0
        pushers = self.max_blocks - takers
        tile = min(self.layout.tile_bytes, max(least, -(-nbytes // pushers // least) * least))
        tiles = max(1, -(-nbytes // tile))
        takers = min(takers, tiles)
        return min(pushers, tiles) + takers, tile, takers

    def _blocks(self, nbytes: int) -> int:
        """`_tiling`'s blocks, with its tile and takers set in the kernels' arguments."""
        blocks, self._args.tile_bytes, self._args.takers = self._tiling(nbytes)
        return blocks

    def lines_per_slot(self, algorithm: str, nbytes: int) -> int:
        """The lines (8 bytes of data and their flags in 16) that all_reduce `algorithm` of
        _LINES pushes into each slot for an array of `nbytes`: the whole array's (one shot)
        or one rank's segment's (two shots); 0 where they do not fit a slot."""
        lines = -(-nbytes // 8)
        if algorithm == "low_latency_two_shot":
            lines = -(-lines // self.size)
        return max(lines, 1) if lines * 16 <= self.layout.slot_bytes else 0

    def _launch(self, kernel: str, blocks: int, stream: int) -> None:
        gpu.launch(self._kernels[kernel], blocks, THREADS, stream, self._params_address)

    def _kernel(self, kernel: str, blocks: int, inp: int, out: int, count: int, *,
                tile: int = 0, takers: int = 0, scale: float = 1.0, root: int = 0,
                ins: Sequence[int] = (), outs: Sequence[int] = ()) -> gpu.KernelLaunch:
        """One launch of `kernel` with its own copy of the argument block (the backend's, with
        this launch's values): queuing it again writes nothing (a cached plan's replay is one
        driver call)."""
        a = KernelArgs.from_buffer_copy(self._args)
        a.inp, a.out, a.count, a.scale, a.root = inp, out, count, scale, root
        a.tile_bytes, a.takers = tile or self.layout.tile_bytes, takers
        for q, ptr in enumerate(ins):
            a.ins[q] = ptr
        for q, ptr in enumerate(outs):
            a.outs[q] = ptr
        return gpu.KernelLaunch(self._kernels[kernel], blocks, THREADS, a)

    # ---- operations: each returns the function that queues it on a stream ------------------------
    def all_reduce(self, x: GpuArray, op: ReduceOp) -> Callable[[int], None]:
        dtype, kind = _TYPES.get(x.dtype), _OPS.get(op)
        algorithm = self.routes.pick("all_reduce", x.nbytes)
        if dtype is None or kind is None or algorithm == NCCL:
            return self.nccl.all_reduce(x, op)
        n, size, ptr, a = self.size, x.dtype.itemsize, x.ptr, self._args
        scale = 1.0 / n if op is ReduceOp.AVG else 1.0
        slot = self.layout.slot_bytes // size      # elements one rank may push per kernel
        # one shot: reduce_scatter's kernel with every rank's piece the whole array
        one, two = f"all_reduce_one_shot_{dtype}_{kind}", f"all_reduce_two_shot_{dtype}_{kind}"
        total = x.size
        if algorithm == "copy_engines":
            if self.layout.ce_ring_bytes and n > 1:
                p = ce.plan(x.size, size, n, self.layout.ce_ring_bytes, self.ce_chunks)
                return self._ring(ce.all_reduce(ptr, p, size, n, scale),
                                  f"ce_step_{dtype}_{kind}")
            algorithm = "two_shot"   # no copy-engine area (ANYCCL_IPC_CE_MB=0): the SMs
        if algorithm in _LINES:
            lines = self.lines_per_slot(algorithm, x.nbytes)
            if lines:   # a thread a line
                blocks = max(1, min(self.max_blocks, -(-lines // THREADS)))
                return self._kernel(f"all_reduce_{algorithm}_{dtype}_{kind}", blocks, ptr, ptr,
                                    total, scale=scale)
            if algorithm == "low_latency_two_shot":
                algorithm = "two_shot"
        # one shot where chosen (or where the other two do not fit), else two shots; arrays
        # beyond one kernel's slots take several kernels, the last piece one shot when it fits
        # the chosen one-shot size
        one_shot = slot if algorithm != "two_shot" else min(slot, self.one_shot_bytes // size)
        if total <= one_shot:   # one kernel: every rank's piece is the whole array
            blocks, tile, takers = self._tiling(x.nbytes)
            return self._kernel(one, blocks, ptr, ptr, total, tile=tile, takers=takers,
                                scale=scale, ins=[ptr] * n)
        if total <= slot * n and algorithm == "two_shot":   # one kernel of two shots
            blocks, tile, takers = self._tiling(-(-total // n) * size)
            return self._kernel(two, blocks, ptr, ptr, total, tile=tile, takers=takers,
                                scale=scale)
        step = slot if algorithm != "two_shot" else slot * n

        def enqueue(stream: int) -> None:
            a.scale = scale
            start = 0
            while start < total:        # arrays beyond one kernel's slots take several
                left = total - start
                if left <= one_shot:
                    count, kernel, per_block = left, one, left * size
                else:
                    count = min(left, step)
                    kernel, per_block = (two, -(-count // n) * size) if step > slot else \
                        (one, count * size)
                a.inp = a.out = ptr + start * size
                a.count = count
                if kernel is one:
                    for q in range(n):
                        a.ins[q] = a.inp
                self._launch(kernel, self._blocks(per_block), stream)
                start += count
        return enqueue

    def _ring(self, job: ce.Ring, kernel: str | None) -> Callable[[int], None]:
        """The enqueue function of the copy engines' `job`, reducing with `kernel`."""
        kernels = _CeKernels(self, kernel, job.itemsize)
        return lambda stream: self._ce.enqueue(stream, job, kernels)

    def _ring_serves(self, mine: GpuArray, x: GpuArray, in_place: bool) -> bool:
        """Whether the copy engines' ring can run a reduce_scatter or all_gather whose own
        piece is `mine` and whose other array is `x`: there is a ring area, and the two are
        apart, or (where `in_place`) the very same array; the ring would overwrite a partly
        shared one before reading it. (reduce_scatter in place on more than 2 ranks keeps
        partial results in the output before it reads its own input there.)"""
        if not self.layout.ce_ring_bytes or self.size == 1:
            return False
        return not overlaps(mine, x) or (in_place and mine.ptr == x.ptr
                                         and mine.nbytes == x.nbytes)

    def reduce_scatter(self, out: GpuArray, inputs: list[GpuArray],
                       op: ReduceOp) -> Callable[[int], None]:
        dtype, kind = _TYPES.get(out.dtype), _OPS.get(op)
        impl = self.routes.pick("reduce_scatter", out.nbytes)
        if dtype is None or kind is None or impl == NCCL:
            return self.nccl.reduce_scatter(out, inputs, op)
        size, n = out.dtype.itemsize, self.size
        scale = 1.0 / n if op is ReduceOp.AVG else 1.0
        if impl == "copy_engines" and self._ring_serves(out, inputs[self.rank], n == 2):
            p = ce.cut(out.size, out.size * n, size, self.layout.ce_ring_bytes, self.ce_chunks)
            return self._ring(ce.reduce_scatter(out.ptr, [i.ptr for i in inputs], p, size,
                                                scale), f"ce_step_{dtype}_{kind}")
        slot = self.layout.slot_bytes // size
        launches = [(0, out.ptr + start * size, [piece.ptr + start * size for piece in inputs],
                     count, *self._tiling(count * size))
                    for start in range(0, out.size, slot)
                    for count in [min(slot, out.size - start)]]
        return self._launches(f"reduce_scatter_{dtype}_{kind}", launches, scale=scale)

    def all_gather(self, outs: list[GpuArray], x: GpuArray) -> Callable[[int], None]:
        impl = self.routes.pick("all_gather", x.nbytes)
        if impl == NCCL:
            return self.nccl.all_gather(outs, x)
        mine = outs[self.rank]
        if impl == "copy_engines" and self._ring_serves(mine, x, True):
            p = ce.cut(x.nbytes, x.nbytes * self.size, 1, self.layout.ce_ring_bytes,
                       self.ce_chunks)
            return self._ring(ce.all_gather([o.ptr for o in outs], x.ptr, self.rank, p), None)
        slot = self.layout.slot_bytes
        launches = [(x.ptr + start, 0, [o.ptr + start for o in outs], count, *self._tiling(count))
                    for start in range(0, x.nbytes, slot)
                    for count in [min(slot, x.nbytes - start)]]
        return self._launches("all_gather", launches, gathers=True)

    def broadcast(self, x: GpuArray, root: int) -> Callable[[int], None]:
        if not self._ipc("broadcast", x.nbytes):
            return self.nccl.broadcast(x, root)
        slot = self.layout.slot_bytes
        launches = [(x.ptr + start, x.ptr + start, [], count, *self._tiling(count))
                    for start in range(0, x.nbytes, slot)
                    for count in [min(slot, x.nbytes - start)]]
        return self._launches("broadcast", launches, root=root)

    def _launches(self, kernel: str,
                  launches: list[tuple[int, int, list[int], int, int, int, int]], *,
                  scale: float = 1.0, root: int = 0,
                  gathers: bool = False) -> Callable[[int], None]:
        """The enqueue function of `kernel` launched once per (inp, out, pointers, count,
        blocks, tile, takers) of `launches`, worked out here so that queuing an operation
        again (a cached plan) only writes the kernels' arguments and launches. `pointers` go
        to outs (gathers) or ins."""
        if len(launches) == 1:
            inp, out, targets, count, blocks, tile, takers = launches[0]
            return self._kernel(kernel, blocks, inp, out, count, tile=tile, takers=takers,
                                scale=scale, root=root,
                                **{"outs" if gathers else "ins": targets})
        a, function, params = self._args, self._kernels[kernel], self._params_address
        launch = gpu.launch

        def enqueue(stream: int) -> None:
            a.scale, a.root = scale, root
            pointers = a.outs if gathers else a.ins
            for inp, out, targets, count, blocks, tile, takers in launches:
                a.inp, a.out, a.count, a.tile_bytes, a.takers = inp, out, count, tile, takers
                for q, ptr in enumerate(targets):
                    pointers[q] = ptr
                launch(function, blocks, THREADS, stream, params)
        return enqueue

    def barrier(self) -> Callable[[int], None]:
        return self._kernel("barrier", 1, 0, 0, 0)

    def reduce(self, x: GpuArray, root: int, op: ReduceOp) -> Callable[[int], None]:
        return self.nccl.reduce(x, root, op)

    def gather(self, x: GpuArray, outs: list[GpuArray] | None,
               root: int) -> Callable[[int], None]:
        return self.nccl.gather(x, outs, root)

    def scatter(self, out: GpuArray, chunks: list[GpuArray] | None,
                root: int) -> Callable[[int], None]:
        return self.nccl.scatter(out, chunks, root)

    def all_to_all(self, outs: list[GpuArray], inputs: list[GpuArray]) -> Callable[[int], None]:
        return self.nccl.all_to_all(outs, inputs)

    exchanges_any_sizes = True   # through NCCL's grouped sends and receives

    def exchange(self, sends: list[GpuArray | None],
                 recvs: list[GpuArray | None]) -> Callable[[int], None]:
        return self.nccl.exchange(sends, recvs)

    # ---- messages --------------------------------------------------------------------------------
    def send(self, x: GpuArray, dst: int, tag: int = 0) -> Callable[[int], None]:
        if not self._ipc("send", x.nbytes):
            return self.nccl.send(x, dst)
        return self._message("send", x, dst, tag)

    def recv(self, x: GpuArray, src: int, tag: int = 0) -> Callable[[int], None]:
        if not self._ipc("recv", x.nbytes):
            return self.nccl.recv(x, src)
        return self._message("recv", x, src, tag)

    def _message(self, kind: str, x: GpuArray, peer: int, tag: int) -> Callable[[int], None]:
        a, nbytes = self._args, x.nbytes
        blocks = max(1, min(self.max_blocks, -(-nbytes // self.layout.chunk_bytes)))
        masked = tag & ((1 << _TAG_BITS) - 1)

        def enqueue(stream: int) -> None:
            a.inp = a.out = x.ptr
            a.count, a.peer, a.tag = nbytes, peer, masked
            self._launch(kind, blocks, stream)
        enqueue.channel = (kind, peer)  # type: ignore[attr-defined]
        return enqueue

    def group(self, calls: list[Callable[[int], None]]) -> Callable[[int], None]:
        """One enqueue function for a batch: NCCL's calls as one NCCL group; the kernels' sends
        and receives each on a side stream of their (direction, peer), forked from and joined
        back to the stream, so a ring of messages larger than the rings cannot deadlock."""
        mine = [c for c in calls if hasattr(c, "channel")]
        theirs = [c for c in calls if not hasattr(c, "channel")]
        fused = self.nccl.group(theirs) if theirs else None
        channels = list(dict.fromkeys(c.channel for c in mine))  # type: ignore[attr-defined]
        while len(self._side) < len(channels):
            self._side.append((gpu.new_stream(self.device), gpu.new_event(self.device)))

        def enqueue(stream: int) -> None:
            if fused is not None:
                fused(stream)
            if not mine:
                return
            gpu.record(self._fork, stream)
            for side, _ in self._side[:len(channels)]:
                gpu.stream_wait(side, self._fork)
            for call in mine:
                call(self._side[channels.index(call.channel)][0])  # type: ignore[attr-defined]
            for side, joined in self._side[:len(channels)]:
                gpu.record(joined, side)
                gpu.stream_wait(stream, joined)
        return enqueue

    # ---- lifetime --------------------------------------------------------------------------------
    def split(self, color: int | None, key: int, label: str,
              store: Store | None = None, group: str = "") -> IpcBackend | NcclBackend | None:
        """Collective over this communicator: the NCCL split, and for the members of each
        color their own peer memory (exchanged through `store` under `group`)."""
        child = self.nccl.split(color, key, label)
        if child is None or store is None:
            return child
        memory = PeerMemory(store, f"{group}/ipc", child.rank, child.size, child.device,
                            self.nccl.timeout_s)
        try:
            return IpcBackend(child, memory, self.policy, _measured(
                self.policy, store, group, child.rank, child.size, child.device,
                self.nccl.timeout_s))
        except BaseException:
            memory.close()
            child.close()
            raise

    def close(self) -> None:
        try:
            self.nccl.close()   # waits for queued work, then frees NCCL
        finally:
            for side, joined in self._side:
                gpu.destroy_event(joined)
                gpu.destroy_stream(side)
            gpu.destroy_event(self._fork)
            self._ce.close()
            self.memory.close()


def _measured(policy: str, store: Store, key: str, rank: int, size: int, device: int,
              timeout_s: float) -> Routes | None:
    """Collective: for policy "auto", the routes every rank agreed on for this job's machine
    shape (routes.py); None for "ipc" (the backend's thresholds route)."""
    return agreed(store, f"{key}/auto", rank, size, device, timeout_s)[1] \
        if policy == "auto" else None


class _CeKernels:
    """ce.Kernels for one copy-engine collective: `ce_step` (the `kernel` named; None where
    the collective only copies), `ce_copy`, flags raised by a one-thread kernel (ce_flags) and
    waited for by another (ce_wait) or, where `ce_memop_wait` is set (lab/ce_modes.py), by
    stream memory operations (cuStreamWaitValue32)."""

    def __init__(self, backend: IpcBackend, kernel: str | None, itemsize: int) -> None:
        self.b, self.kernel, self.itemsize = backend, kernel, itemsize

    def _pointers(self, first: list[int], second: list[int]) -> None:
        a = self.b._args
        for q in range(self.b.size):
            a.ins[q] = first[q] if q < len(first) else 0
            a.outs[q] = second[q] if q < len(second) else 0

    def step(self, stream: int, inp: int, arrived: int, out: int, count: int,
             scale: float) -> None:
        self._pointers([arrived], [])
        a = self.b._args
        a.inp, a.out, a.count, a.scale = inp, out, count, scale
        assert self.kernel is not None, "a collective that only copies has no reducing step"
        self.b._launch(self.kernel, self.b._blocks(count * self.itemsize), stream)

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        self._pointers([src], [])
        a = self.b._args
        a.inp, a.out, a.count = 0, dst, nbytes
        self.b._launch("ce_copy", self.b._blocks(nbytes), stream)

    def flags(self, stream: int, clear: list[int], raise_: list[int]) -> None:
        self._pointers(clear, raise_)
        gpu.launch(self.b._kernels["ce_flags"], 1, 32, stream, self.b._params_address)

    def wait(self, stream: int, flags: list[int]) -> None:
        if self.b.ce_memop_wait:
            for flag in flags:
                gpu.wait_value(stream, flag, 1)
            return
        self._pointers(flags, [])
        gpu.launch(self.b._kernels["ce_wait"], 1, 32, stream, self.b._params_address)


def creator(policy: str) -> Callable[[GpuContext], IpcBackend | NcclBackend]:
    """The registry's create function for `policy` ("ipc" or "auto")."""
    def create(ctx: GpuContext) -> IpcBackend | NcclBackend:
        gpu.set_device(ctx.device)
        ctx.meet()  # NCCL's own rendezvous has no deadline and cannot be aborted: meet first
        if len(set(getattr(ctx.host, "hosts", ()))) > 1:
            # ranks on several hosts: peer memory cannot reach between them, so every GPU
            # collective runs on NCCL (its own network transport); a group inside one host
            # (a split) has a host backend of that host alone, and gets the kernels
            return NcclBackend.create(ctx.store, f"{ctx.key}/nccl", ctx.rank, ctx.size,
                                      ctx.device, ctx.label, ctx.timeout_s, ctx.host.lost_peer)
        return IpcBackend.create(ctx.store, ctx.key, ctx.rank, ctx.size, ctx.device, ctx.label,
                                 ctx.timeout_s, ctx.host.lost_peer, policy=policy)
    return create


def status() -> str:
    """What `anyccl info` says of the ipc backend here."""
    from .. import nccl

    missing = [str(path) for path in compiler.SOURCES if not path.is_file()]
    if missing:
        return (f"not usable: this installation of anyccl lacks its kernels' source "
                f"({', '.join(missing)})")
    try:
        try:
            from cuda.core import Program  # noqa: F401
        except ImportError:
            from cuda.core.experimental import Program  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to load means: not usable here
        nvrtc = False
    else:
        nvrtc = True
    if nccl.version() and nvrtc:
        return "available (anyccl's kernels over CUDA IPC, compiled by NVRTC; NCCL for the rest)"
    from ... import gpu

    return "not usable: pip install 'anyccl[gpu]' (cuda-core, NVRTC and nccl4py)" \
        if gpu.machine_has_gpu() else gpu.NO_GPU
