"""The copy-engine ring (backends/ipc/ce.py: all_reduce, reduce_scatter, all_gather), checked
without a GPU: what each rank queues -- copies, flag writes, flag waits, events, the local
reducing and copying kernels -- is executed by a simulator of N ranks' streams in random orders
(every order CUDA could choose), with several calls queued back to back as an eager program
does. It must always finish (no wait that is never satisfied, also with every stream of a rank
sharing one hardware queue) and every rank must end with the exact result; the cut must cover
every element once. The copy engines and
kernels themselves are tested on GPUs (tests/test_gpu_ipc.py)."""

from __future__ import annotations

import ctypes
import random
from types import SimpleNamespace

import numpy as np
import pytest

from anyccl import ReduceOp, gpu
from anyccl.backends.ipc import backend as ipc
from anyccl.backends.ipc import ce, compiler
from anyccl.backends.ipc.memory import KernelArgs, Layout, PeerAddresses
from anyccl.backends.ipc.routes import Routes
from anyccl.buffers import GpuArray


@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("count", [1, 7, 1000, 65536 * 5 + 3, 10_000_019, 300_000_001])
@pytest.mark.parametrize("slot_mb", [1, 32, 256])
def test_the_cut_covers_every_element_once_in_aligned_chunks_that_fit_the_slots(
        nranks, itemsize, count, slot_mb):
    slot = slot_mb << 20
    p = ce.plan(count, itemsize, nranks, slot)
    assert p.seg * itemsize % 16 == 0 and p.seg * nranks >= count
    assert p.chunk * itemsize % (64 << 10) == 0 and 2 * p.chunk * itemsize <= slot
    assert 2 <= p.positions <= ce.CE_POSITIONS and p.positions * p.chunk * itemsize <= slot
    assert p.chunks * p.chunk >= p.seg
    covered = 0
    for q in range(nranks):
        for k in range(p.chunks):
            start, n = p.extent(q, k)
            assert n == 0 or q * p.seg + start == covered           # in order, no gap
            covered += n
    assert covered == count
    if ce.CHUNKS * ce.MIN_CHUNK_BYTES <= p.seg * itemsize <= ce.CHUNKS * (slot // 2):
        assert p.chunks == ce.CHUNKS          # 1/CHUNKS of a segment per chunk, where it fits


class Simulator:
    """N ranks' GPU streams: queues of operations, run one at a time in random order."""

    def __init__(self, nranks: int, shared_queue: bool, seed: int) -> None:
        self.heap = np.zeros(1 << 26, np.uint8)
        self.top = 4096
        self.queues: dict[tuple[int, int], list] = {}
        self.rank = 0                      # whose calls are being queued
        self.shared = shared_queue
        self.random = random.Random(seed)
        self.recorded: dict[int, int] = {}  # event -> the last record op queued
        self.done: set[int] = set()         # record ops executed
        self.ids = iter(range(10, 1 << 30))

    def alloc(self, nbytes: int) -> int:
        address = self.top
        self.top += -(-nbytes // 4096) * 4096
        assert self.top <= self.heap.size
        return address

    def view(self, address: int, nbytes: int) -> np.ndarray:
        return self.heap[address:address + nbytes]

    def word(self, address: int) -> np.ndarray:
        return self.heap[address:address + 4].view(np.uint32)

    def queue(self, stream: int, op: tuple) -> None:
        key = (self.rank, 0 if self.shared else stream)
        self.queues.setdefault(key, []).append(op)

    # the gpu functions ce.py calls, queueing instead of running
    def install(self, monkeypatch) -> None:
        ids = self.ids
        monkeypatch.setattr(gpu, "new_stream", lambda device: next(ids))
        monkeypatch.setattr(gpu, "new_event", lambda device: next(ids))

        def record(event, stream):
            op = ("record", next(ids))
            self.recorded[event] = op[1]
            self.queue(stream, op)
        monkeypatch.setattr(gpu, "record", record)
        monkeypatch.setattr(gpu, "stream_wait", lambda stream, event: self.queue(
            stream, ("after", self.recorded.get(event))))
        monkeypatch.setattr(gpu, "copy_async", lambda dst, src, nbytes, stream: self.queue(
            stream, ("copy", dst, src, nbytes)))
        monkeypatch.setattr(gpu, "wait_value", lambda stream, address, value: self.queue(
            stream, ("wait", address, value)))

    def runnable(self, op: tuple) -> bool:
        if op[0] == "after":
            return op[1] is None or op[1] in self.done
        if op[0] == "wait":
            diff = (int(self.word(op[1])[0]) - op[2]) & 0xFFFFFFFF   # CUDA: (int32)(word -
            return diff < 1 << 31                                     # value) >= 0
        return True

    def run(self) -> None:
        """Run everything queued; AssertionError if some stream can never go on."""
        while any(self.queues.values()):
            ready = [q for q in self.queues.values() if q and self.runnable(q[0])]
            assert ready, "deadlock: " + str({k: q[0] for k, q in self.queues.items() if q})
            op = self.random.choice(ready).pop(0)
            kind = op[0]
            if kind == "record":
                self.done.add(op[1])
            elif kind == "copy":
                _, dst, src, nbytes = op
                self.view(dst, nbytes)[...] = self.view(src, nbytes).copy()
            elif kind == "flags":             # ce_flags: clear, then raise
                for address in op[1]:
                    self.word(address)[0] = 0
                for address in op[2]:
                    self.word(address)[0] = 1
            elif kind == "copy kernel":       # ce_copy: bytes
                _, dst, src, nbytes = op
                self.view(dst, nbytes)[...] = self.view(src, nbytes).copy()
            elif kind == "kernel":            # ce_step: out = (inp + arrived) * scale, or
                _, inp, arrived, out, count, scale = op              # out = arrived
                got = self.view(arrived, 4 * count).view(np.float32).astype(np.float64)
                got = (got + self.view(inp, 4 * count).view(np.float32)) * scale
                self.view(out, 4 * count).view(np.float32)[...] = got


FLAGS_KERNEL, WAIT_KERNEL, COPY_KERNEL = 2, 3, 4   # simulated function handles (ce_step's: 1)


class SimMemory(PeerAddresses):
    """The ipc backend's peer memory (memory.py) over the simulator's allocations: every rank's
    copy-engine ring area and flags where memory.py's addresses put them, and a status block."""

    def __init__(self, layout: Layout, rank: int, size: int, datas: list[int],
                 sigs: list[int]) -> None:
        super().__init__(layout, rank, size, datas, sigs)
        self.status_device = 0
        self.status = (ctypes.c_uint64 * 8)()

    def aborted(self) -> bool:
        return False


class SimNccl:
    """The NCCL side, as far as the copy engines' all_reduce sees it: rank, size, device and
    the queue whose watch list the ipc backend joins."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.device = rank, size, 0
        self.queue = SimpleNamespace(watch=lambda **kinds: None)


def make_ranks(sim: Simulator, nranks: int, monkeypatch,
               sync: str = "kernels") -> list[ipc.IpcBackend]:
    """Every rank's ipc backend, made by its constructor over the simulator."""
    monkeypatch.setenv("ANYCCL_IPC_CE_MB", "1")   # a small area: chunks take turns in positions
    layout = Layout(nranks)
    ce_bases = [sim.alloc(layout.ce_ring_bytes) for _ in range(nranks)]
    sig_bases = [sim.alloc(8 * layout.ce_flag_words) for _ in range(nranks)]
    kernels = {f"ce_step_float32_{op}": 1 for op in ("sum", "min", "max")}
    kernels["ce_flags"], kernels["ce_wait"], kernels["ce_copy"] = \
        FLAGS_KERNEL, WAIT_KERNEL, COPY_KERNEL
    kernels["reduce_scatter_float32_sum"] = 5     # the SM kernels (not simulated)
    monkeypatch.setattr(compiler, "kernels", lambda device: kernels)
    ranks = []
    for r in range(nranks):
        memory = SimMemory(layout, r, nranks, [base - layout.ce_offset for base in ce_bases],
                           [base - layout.ce_sig_offset for base in sig_bases])
        b = ipc.IpcBackend(SimNccl(r, nranks), memory, "ipc")
        b.max_blocks, b.ll_bytes, b.one_shot_bytes, b.ce_bytes = 128, 16 << 10, 256 << 10, 1 << 20
        b.routes = Routes.kernels(b.ll_bytes, b.one_shot_bytes, b.ce_bytes, "test thresholds",
                                  ranks=nranks)
        b.ce_chunks, b.ce_memop_wait = ce.CHUNKS, sync == "memop-wait"
        ranks.append(b)

    def launch(function, blocks, threads, stream, params):  # the kernel: run by the simulator
        a = KernelArgs.from_address(ctypes.c_void_p.from_address(params).value)
        if function == FLAGS_KERNEL:
            sim.queue(stream, ("flags", [p for p in a.ins[:nranks] if p],
                               [p for p in a.outs[:nranks] if p]))
        elif function == COPY_KERNEL:
            sim.queue(stream, ("copy kernel", a.out, a.ins[0], a.count))
        elif function == WAIT_KERNEL:
            for p in a.ins[:nranks]:
                if p:
                    sim.queue(stream, ("wait", p, 1))
        else:
            sim.queue(stream, ("kernel", a.inp, a.ins[0], a.out, a.count, a.scale))
    monkeypatch.setattr(gpu, "launch", launch)
    return ranks


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("shared_queue", [False, True])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sync", ["kernels", "memop-wait"])
def test_back_to_back_calls_finish_in_any_order_with_the_exact_sum(nranks, shared_queue, seed,
                                                                   sync, monkeypatch):
    sim = Simulator(nranks, shared_queue, seed)
    sim.install(monkeypatch)
    ranks = make_ranks(sim, nranks, monkeypatch, sync)
    # per rank: a 4 MiB array (more chunks than positions: positions are reused) and an odd one
    sizes = [1 << 20, 300_007]
    arrays = [[sim.alloc(4 * n) for n in sizes] for _ in range(nranks)]
    state = []                                 # what each array should hold, in float64
    for i, n in enumerate(sizes):
        values = [np.arange(n, dtype=np.float32) % 97 + r for r in range(nranks)]
        for r in range(nranks):
            sim.view(arrays[r][i], 4 * n).view(np.float32)[...] = values[r]
        state.append(np.sum(values, axis=0, dtype=np.float64))   # after a first SUM
    calls = [(0, ReduceOp.SUM), (1, ReduceOp.SUM), (0, ReduceOp.SUM), (0, ReduceOp.AVG)]
    for i, op in calls[2:]:                    # the later calls, on every rank's equal values
        state[i] = state[i] * nranks if op is ReduceOp.SUM else state[i]
    for i, op in calls:                        # queued back to back, then run
        for r, b in enumerate(ranks):
            sim.rank = r
            x = GpuArray(arrays[r][i], sizes[i], np.dtype(np.float32), 0, 7, "test", None)
            b.all_reduce(x, op)(7)
    sim.run()
    for r in range(nranks):
        for i, n in enumerate(sizes):
            got = sim.view(arrays[r][i], 4 * n).view(np.float32)
            np.testing.assert_allclose(got, state[i], rtol=1e-6, err_msg=f"rank {r}, array {i}")


@pytest.mark.parametrize("sync", ["kernels", "memop-wait"])
def test_every_flag_a_call_raises_is_cleared_when_it_ends(sync, monkeypatch):
    sim = Simulator(2, False, 0)
    sim.install(monkeypatch)
    ranks = make_ranks(sim, 2, monkeypatch, sync)
    x = [sim.alloc(4 << 20) for _ in range(2)]
    for r, b in enumerate(ranks):
        sim.rank = r
        b.all_reduce(GpuArray(x[r], 1 << 20, np.dtype(np.float32), 0, 7, "test", None),
                     ReduceOp.SUM)(7)
    sim.run()
    layout = ranks[0].layout
    for m in (b.memory for b in ranks):
        flags = sim.view(m.sigs[m.rank] + layout.ce_sig_offset, 8 * layout.ce_flag_words)
        assert not flags.any()                 # the next call (or a graph replay) starts clean


def _array(address: int, count: int, dtype=np.float32) -> GpuArray:
    return GpuArray(address, count, np.dtype(dtype), 0, 7, "test", None)


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("shared_queue", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_reduce_scatter_and_all_gather_back_to_back_finish_in_any_order_exactly(
        nranks, shared_queue, seed, monkeypatch):
    sim = Simulator(nranks, shared_queue, seed)
    sim.install(monkeypatch)
    ranks = make_ranks(sim, nranks, monkeypatch)
    count = 300_007        # a rank's piece: 1.2 MB, three chunks of a 1 MiB area's halves
    values = [[(np.arange(count) % 89 + 3 * r + q).astype(np.float32) for q in range(nranks)]
              for r in range(nranks)]
    inputs = [[sim.alloc(4 * count) for _ in range(nranks)] for _ in range(nranks)]
    for r in range(nranks):
        for q in range(nranks):
            sim.view(inputs[r][q], 4 * count).view(np.float32)[...] = values[r][q]
    sums, avgs = ([sim.alloc(4 * count) for _ in range(nranks)] for _ in range(2))
    # all_gather: rank 0 in place (its input is its own piece of the output), the others apart
    pieces = [np.frombuffer(np.random.default_rng(seed * 8 + r).bytes(4 * count + 3), np.uint8)
              for r in range(nranks)]
    gathered = [[sim.alloc(4 * count + 3) for _ in range(nranks)] for _ in range(nranks)]
    xs = [gathered[0][0]] + [sim.alloc(4 * count + 3) for _ in range(1, nranks)]
    for r in range(nranks):
        sim.view(xs[r], pieces[r].size)[...] = pieces[r]
    for r, b in enumerate(ranks):              # queued back to back, then run
        sim.rank = r
        ins = [_array(a, count) for a in inputs[r]]
        b.reduce_scatter(_array(sums[r], count), ins, ReduceOp.SUM)(7)
        b.all_gather([_array(a, 4 * count + 3, np.uint8) for a in gathered[r]],
                     _array(xs[r], 4 * count + 3, np.uint8))(7)
        b.reduce_scatter(_array(avgs[r], count), ins, ReduceOp.AVG)(7)
    sim.run()
    for r in range(nranks):
        want = np.sum([values[q][r] for q in range(nranks)], axis=0, dtype=np.float64)
        got = sim.view(sums[r], 4 * count).view(np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"reduce_scatter, rank {r}")
        got = sim.view(avgs[r], 4 * count).view(np.float32)
        np.testing.assert_allclose(got, want / nranks, rtol=1e-6, err_msg=f"AVG, rank {r}")
        for q in range(nranks):
            assert np.array_equal(sim.view(gathered[r][q], pieces[q].size), pieces[q]), \
                f"all_gather: rank {r}'s piece from {q}"
    layout = ranks[0].layout
    for m in (b.memory for b in ranks):        # every flag cleared again
        assert not sim.view(m.sigs[m.rank] + layout.ce_sig_offset, 8 * layout.ce_flag_words).any()


@pytest.mark.parametrize("nranks", [2, 3])
def test_reduce_scatter_in_place_takes_the_ring_only_where_it_reads_before_it_writes(
        nranks, monkeypatch):
    sim = Simulator(nranks, False, 0)
    sim.install(monkeypatch)
    ranks = make_ranks(sim, nranks, monkeypatch)
    count = 300_007
    b = ranks[0]
    whole = sim.alloc(4 * count * nranks)
    ins = [_array(whole + 4 * count * q, count) for q in range(nranks)]
    queued = b.reduce_scatter(ins[0], ins, ReduceOp.SUM)
    # 2 ranks: the one step reads out (= the own input) where it writes it; more ranks keep
    # partial results in out before reading the own input there: the SM kernels run it
    assert isinstance(queued, gpu.KernelLaunch) == (nranks > 2)
    shifted = _array(whole + 4, count)           # partly shared with the own input: kernels
    assert isinstance(b.reduce_scatter(shifted, ins, ReduceOp.SUM), gpu.KernelLaunch)
