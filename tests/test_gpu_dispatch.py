"""The communicator's GPU path without a GPU: argument checks, routing to the GPU backend,
stream ordering (async on the backend's stream after the producer's work, blocking right on
the caller's stream, Work.wait making the caller's stream wait), and the error paths (a
deadline aborts the queue, the next call raises, a lost peer), on tests/fake_gpu.py's simulated
device. The GPU backend here is registered from this file; its "kernels" run on the fake
streams and move bytes through a host backend of their own, queued through anyccl's real
`GpuQueue`."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Iterator
from typing import Any, Callable

import numpy as np
import pytest
from fake_gpu import FakeDevice, FakeGpuArray, install, launch
from harness import eventually, run_ranks

import anyccl
from anyccl.backends import registry
from anyccl.backends.gpu_base import QueuedGpuBackend
from anyccl.backends.gpu_queue import Enqueue, GpuQueue
from anyccl.buffers import GpuArray
from anyccl.ops import ReduceOp
from anyccl.trace import OpRecord

pytestmark = pytest.mark.shm_only  # the fake GPU's wire is its own shm backend
SETUP = {"ANYCCL_TEST_SETUP": "test_gpu_dispatch:setup", "ANYCCL_BACKEND": "cpu:shm,cuda:fake"}
DEVICE: FakeDevice | None = None


def _host(x: GpuArray) -> np.ndarray:
    """The fake device's memory is host memory: a NumPy view of a GPU array."""
    if not x.nbytes:
        return np.empty(0, x.dtype)
    return np.frombuffer((ctypes.c_uint8 * x.nbytes).from_address(x.ptr), x.dtype)


class FakeGpuBackend(QueuedGpuBackend):
    """GPU arrays on the fake device, reduced and moved by a host backend of their own from
    "kernels" queued on the fake streams."""

    name = "fake"

    def __init__(self, ctx: registry.GpuContext) -> None:
        self.rank, self.size, self.device, self.timeout_s = ctx.rank, ctx.size, ctx.device, \
            ctx.timeout_s
        self.wire = ctx.host.subgroup(list(range(ctx.size)), f"{ctx.key}/wire", ctx.timeout_s)
        self.queue = GpuQueue(ctx.device, ctx.label, ctx.host.lost_peer, rank=ctx.rank,
                              what="fake GPU communicator")
        self.kernel_errors: list[BaseException] = []
        self.aborted = False
        self.queue.watch(health=lambda record: self.kernel_errors[0] if self.kernel_errors
                         else None, abort=self._abort)

    def _abort(self) -> None:
        self.aborted = True

    def _kernel(self, what: str, body: Callable[[OpRecord], None]) -> Enqueue:
        """A "kernel" that runs `body(record)` on the wire, `record` being the operation's
        options there."""
        def run() -> None:
            if self.aborted:
                return
            record = OpRecord(what, 0)
            # the queue's deadline, not the wire's, is what a stuck operation runs into
            record.deadline = time.monotonic() + 10 * self.timeout_s
            try:
                body(record)
            except BaseException as exc:  # a kernel that failed: the watchdog reports it
                self.kernel_errors.append(exc)
        return lambda stream: launch(DEVICE, stream, run)

    def _messages(self, finished: Callable[[], bool]) -> None:
        """Progress the wire's posted messages until `finished()` (for a communicator the host
        engine does this; here the fake stream drives a backend of its own). They fail at
        their deadline by themselves."""
        while not finished():
            self.wire.progress()
            if not finished():
                self.wire.doorbell.sleep(1e-3)

    def all_reduce(self, x: GpuArray, op: ReduceOp) -> Enqueue:
        return self._kernel("all_reduce", lambda r: self.wire.all_reduce(_host(x), op, r))

    def reduce(self, x: GpuArray, root: int, op: ReduceOp) -> Enqueue:
        return self._kernel("reduce", lambda r: self.wire.reduce(_host(x), root, op, r))

    def broadcast(self, x: GpuArray, root: int) -> Enqueue:
        return self._kernel("broadcast", lambda r: self.wire.broadcast(_host(x), root, r))

    def all_gather(self, outs: list[GpuArray], x: GpuArray) -> Enqueue:
        return self._kernel("all_gather", lambda r: self.wire.all_gather(
            [_host(o) for o in outs], _host(x), r))

    def gather(self, x: GpuArray, outs: list[GpuArray] | None, root: int) -> Enqueue:
        return self._kernel("gather", lambda r: self.wire.gather(
            _host(x), [_host(o) for o in outs] if outs is not None else None, root, r))

    def scatter(self, out: GpuArray, chunks: list[GpuArray] | None, root: int) -> Enqueue:
        return self._kernel("scatter", lambda r: self.wire.scatter(
            _host(out), [_host(c) for c in chunks] if chunks is not None else None, root, r))

    def reduce_scatter(self, out: GpuArray, inputs: list[GpuArray], op: ReduceOp) -> Enqueue:
        return self._kernel("reduce_scatter", lambda r: self.wire.reduce_scatter(
            _host(out), [_host(i) for i in inputs], op, r))

    def all_to_all(self, outs: list[GpuArray], inputs: list[GpuArray]) -> Enqueue:
        return self._kernel("all_to_all", lambda r: self.wire.all_to_all(
            [_host(o) for o in outs], [_host(i).copy() for i in inputs], r))

    def _message(self, kind: str, x: GpuArray, peer: int, tag: int) -> Enqueue:
        def body(record: OpRecord) -> None:
            done: list[BaseException | None] = []
            post = self.wire.post_send if kind == "send" else self.wire.post_recv
            post(_host(x), peer, tag, record, done.append)
            self._messages(lambda: bool(done))
            if done[0] is not None:
                raise done[0]
        return self._kernel(kind, body)

    def send(self, x: GpuArray, dst: int, tag: int = 0) -> Enqueue:
        return self._message("send", x, dst, tag)

    def recv(self, x: GpuArray, src: int, tag: int = 0) -> Enqueue:
        return self._message("recv", x, src, tag)

    def group(self, calls: list[Enqueue]) -> Enqueue:
        def enqueue(stream: int) -> None:
            for call in calls:
                call(stream)
        return enqueue

    def split(self, color: int | None, key: int, label: str, store: Any = None,
              group: str = "") -> None:
        return None  # a child communicator makes its own on first use

    def close(self) -> None:
        self.queue.drain()
        self.queue.close()
        self.wire.close()


class FakeExchangeBackend(FakeGpuBackend):
    """The fake backend that also exchanges pieces of any size, as NCCL's grouped sends and
    receives do (the uneven collectives then move their pieces as they are)."""

    name = "fake-exchange"
    exchanges_any_sizes = True

    def exchange(self, sends: list[GpuArray | None],
                 recvs: list[GpuArray | None]) -> Enqueue:
        def body(record: OpRecord) -> None:
            done: list[BaseException | None] = []
            posted = 0
            for peer, (src, out) in enumerate(zip(sends, recvs)):
                if peer == self.rank:
                    if src is not None and out is not None and out.nbytes:
                        _host(out)[...] = _host(src)
                    continue
                if src is not None and src.nbytes:
                    self.wire.post_send(_host(src).copy(), peer, 7, record, done.append)
                    posted += 1
                if out is not None and out.nbytes:
                    self.wire.post_recv(_host(out), peer, 7, record, done.append)
                    posted += 1
            self._messages(lambda: len(done) == posted)
            failed = next((e for e in done if e is not None), None)
            if failed is not None:
                raise failed
        return self._kernel("exchange", body)


def setup() -> None:
    """In every rank, before anyccl.init(): the fake device, and the backends registered."""
    global DEVICE
    DEVICE = install()
    for backend in (FakeGpuBackend, FakeExchangeBackend):
        registry.register_gpu(registry.GpuEntry(backend.name, "fake GPU arrays (tests)", backend,
                                                lambda: "available (tests)"))


def _landed(stream: int = 0) -> None:
    from anyccl import gpu

    gpu.synchronize_stream(stream)


# ---- every collective through the GPU path ---------------------------------------------------
def check_every_collective(comm) -> bool:
    n, r = comm.size, comm.rank
    assert comm.backend == "cpu:shm,cuda:fake"
    x = FakeGpuArray(np.arange(6, dtype=np.float32) + r)
    comm.all_reduce(x)
    _landed()
    assert np.array_equal(x.a, np.arange(6) * n + n * (n - 1) / 2), x.a
    comm.all_reduce(x, op=anyccl.ReduceOp.MAX)
    b = FakeGpuArray(np.full(4, float(r)))
    comm.broadcast(b, src=n - 1)
    red = FakeGpuArray(np.full(3, r + 1, np.int64))
    comm.reduce(red, dst=0)
    whole = FakeGpuArray(np.zeros(2 * n, np.int32))
    comm.all_gather(whole, FakeGpuArray(np.full(2, r, np.int32)))
    pieces = [FakeGpuArray(np.zeros(2, np.int32)) for _ in range(n)]
    comm.all_gather(pieces, FakeGpuArray(np.full(2, 10 + r, np.int32)))
    rs = FakeGpuArray(np.zeros(2))
    comm.reduce_scatter(rs, FakeGpuArray(np.arange(2 * n, dtype=np.float64) * (r + 1)))
    a2a = FakeGpuArray(np.arange(n, dtype=np.int64) + 100 * r)
    comm.all_to_all(a2a, a2a)  # in place
    got = FakeGpuArray(np.zeros(1))
    outs = [FakeGpuArray(np.zeros(1)) for _ in range(n)] if r == 0 else None
    comm.gather(FakeGpuArray(np.array([float(r)])), outs, dst=0)
    chunks = [FakeGpuArray(np.array([5.0 * j])) for j in range(n)] if r == 0 else None
    comm.scatter(got, chunks, src=0)
    _landed()
    assert np.array_equal(b.a, np.full(4, n - 1.0))
    assert np.array_equal(red.a, np.full(3, n * (n + 1) // 2 if r == 0 else r + 1))
    assert np.array_equal(whole.a, np.repeat(np.arange(n, dtype=np.int32), 2))
    assert [int(p.a[0]) for p in pieces] == [10 + q for q in range(n)]
    assert np.array_equal(rs.a, np.arange(2 * r, 2 * r + 2) * n * (n + 1) / 2)
    assert np.array_equal(a2a.a, np.arange(n) * 100 + r)
    assert got.a[0] == 5.0 * r
    if r == 0:
        assert [o.a[0] for o in outs] == list(range(n))
    return True


@pytest.mark.parametrize("world_size", (1, 2, 3))
def test_every_collective_runs_through_the_gpu_path(world_size):
    assert all(run_ranks(check_every_collective, world_size, env=SETUP))


def check_messages(comm) -> bool:
    peer, source = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = FakeGpuArray(np.zeros(4))
    if comm.rank % 2 == 0:
        comm.send(FakeGpuArray(np.full(4, float(comm.rank))), peer, tag=2)
        comm.recv(got, source, tag=2)
    else:
        comm.recv(got, source, tag=2)
        comm.send(FakeGpuArray(np.full(4, float(comm.rank))), peer, tag=2)
    _landed()
    return bool((got.a == source).all())


def test_gpu_messages_run_through_the_gpu_path():
    assert all(run_ranks(check_messages, 2, env=SETUP))


def check_sendrecv(comm) -> bool:
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = FakeGpuArray(np.zeros(4))
    sender = comm.sendrecv(FakeGpuArray(np.full(4, float(comm.rank))), right, got, left, tag=3)
    _landed()
    return sender == left and bool((got.a == left).all())


@pytest.mark.parametrize("world_size", (2, 3))
def test_sendrecv_of_gpu_arrays_runs_as_one_group_around_a_ring(world_size):
    assert all(run_ranks(check_sendrecv, world_size, env=SETUP))


# ---- the uneven ("v") forms on GPU arrays -----------------------------------------------------
def check_uneven_forms(comm) -> dict[str, Any]:
    from anyccl import gpu

    n, r = comm.size, comm.rank
    sends = [(r + 2 * j) % 4 for j in range(n)]          # zeros included
    receives = [(j + 2 * r) % 4 for j in range(n)]
    inp = np.concatenate([np.full(c, 100.0 * r + j) for j, c in enumerate(sends)])
    blocking, on_stream, later = (np.full(sum(receives), -1.0) for _ in range(3))
    allocations = len(DEVICE.memory)
    mallocs: list[int] = []
    malloc = gpu.malloc_async
    gpu.malloc_async = lambda nbytes, stream: mallocs.append(nbytes) or malloc(nbytes, stream)
    comm.all_to_all(FakeGpuArray(blocking), FakeGpuArray(inp), out_splits=receives,
                    in_splits=sends)
    stream = gpu.new_stream(0)
    slow = np.zeros(inp.size)    # a slow producer writes the input on the caller's stream
    launch(DEVICE, stream, lambda: (time.sleep(0.2), slow.__setitem__(slice(None), inp)))
    comm.all_to_all(FakeGpuArray(on_stream), FakeGpuArray(slow), stream=stream,
                    out_splits=receives, in_splits=sends)
    work = comm.all_to_all(FakeGpuArray(later), FakeGpuArray(inp), async_op=True,
                           out_splits=receives, in_splits=sends)
    work.wait()
    size = lambda j: 2 * j + 1  # noqa: E731 - rank j's size in the v forms
    mine = np.arange(size(r), dtype=np.float32) + 100 * r
    gathered = [np.full(size(j), -1, np.float32) for j in range(n)]
    comm.all_gather([FakeGpuArray(g) for g in gathered], FakeGpuArray(mine))
    at_root = [np.full(size(j), -1, np.float32) for j in range(n)] if r == n - 1 else None
    comm.gather(FakeGpuArray(mine), [FakeGpuArray(g) for g in at_root] if at_root else None,
                n - 1, uneven=True)
    out = np.full(size(r), -1, np.float32)
    chunks = [np.full(size(j), 10.0 * j, np.float32) for j in range(n)] if r == 0 else None
    comm.scatter(FakeGpuArray(out), [FakeGpuArray(c) for c in chunks] if chunks else None, 0,
                 uneven=True)
    gpu.synchronize_stream(stream)
    _landed()
    gpu.malloc_async = malloc
    scratch_left = len(DEVICE.memory) - allocations
    refused, untouched = [], np.full(sum(receives), -1.0)
    bad = list(receives)
    if r == 0:   # rank 0 expects one element from itself and none from rank 1: all ranks raise
        bad[0], bad[1] = bad[0] + 1, bad[1] - 1
    backend = comm.gpu_backend

    def refuse(outs: Any, inputs: Any) -> None:   # as NCCL refuses what it cannot do
        raise anyccl.UnsupportedError("this transport cannot (a test)")
    backend.all_to_all = refuse
    backend.exchange = refuse
    allocations = len(DEVICE.memory)
    for call in (lambda: comm.all_to_all(FakeGpuArray(untouched), FakeGpuArray(inp),
                                         out_splits=bad, in_splits=sends),
                 lambda: comm.all_to_all(FakeGpuArray(untouched), inp, out_splits=receives,
                                         in_splits=sends),
                 lambda: comm.all_to_all(FakeGpuArray(untouched), FakeGpuArray(inp),
                                         out_splits=receives, in_splits=sends)):
        try:
            call()
        except anyccl.AnycclError as exc:
            refused.append(str(exc))
    del backend.all_to_all, backend.exchange
    _landed()
    return {"a2a": (blocking, on_stream, later), "gathered": gathered, "at_root": at_root,
            "backend": comm.gpu_backend.name, "padded": len(mallocs),
            "out": out, "scratch_left": scratch_left, "refused": refused,
            "untouched": bool((untouched == -1).all()),
            "refused_scratch_left": len(DEVICE.memory) - allocations}


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("backend", ("fake", "fake-exchange"))   # padded; pieces as they are
def test_uneven_forms_of_gpu_arrays_move_every_piece_in_stream_order(world_size, backend):
    n = world_size
    env = {**SETUP, "ANYCCL_BACKEND": f"cpu:shm,cuda:{backend}"}
    for r, got in enumerate(run_ranks(check_uneven_forms, n, env=env)):
        expected = np.concatenate([np.full((j + 2 * r) % 4, 100.0 * j + r) for j in range(n)])
        for way, out in zip(("blocking", "stream=", "async"), got["a2a"]):
            assert (out == expected).all(), (r, way, out, expected)
        sizes = [2 * j + 1 for j in range(n)]
        pieces = [np.arange(s, dtype=np.float32) + 100 * j for j, s in enumerate(sizes)]
        assert all((g == p).all() for g, p in zip(got["gathered"], pieces)), got["gathered"]
        if r == n - 1:
            assert all((g == p).all() for g, p in zip(got["at_root"], pieces)), got["at_root"]
        assert (got["out"] == 10.0 * r).all() and got["out"].size == sizes[r]
        assert got["scratch_left"] == 0, "padded buffers were not given back"
        assert "split sizes of the ranks do not match" in got["refused"][0], got["refused"]
        assert "out is a GPU array but inp is in host memory" in got["refused"][1], got["refused"]
        assert "all_to_all: this transport cannot (a test)" in got["refused"][2], got["refused"]
        assert got["untouched"], "a refused all_to_all wrote its output"
        assert got["refused_scratch_left"] == 0, "a refused call kept its padded buffers"
        assert got["backend"] == backend
        # padded: scratch for each of the 6 calls; exchanged: each piece as it is, no scratch
        assert got["padded"] >= 6 if backend == "fake" else got["padded"] == 0, got["padded"]


def check_async_replays(comm) -> dict[str, Any]:
    """Repeated async calls on the same arrays (a GradientAverager's buckets, step after step):
    the first plans, the next replay on the backend's stream after the caller's; the queued
    operation holds the call's array until it is done."""
    import gc
    import weakref

    n, r = comm.size, comm.rank
    with _as_torch_tensors():
        comm.all_reduce(FakeGpuArray(np.zeros(2, np.float32)))  # plans are kept from now on
        x = np.zeros(4, np.float32)
        right = []
        for step in range(4):
            x[...] = r + step
            work = comm.all_reduce(FakeGpuArray(x), async_op=True)
            work.wait()                       # the caller's stream waits for it
            _landed()
            right.append(bool((x == sum(q + step for q in range(n))).all()))
        launch(DEVICE, 0, lambda: time.sleep(0.3))   # the caller's stream is busy a while
        array = FakeGpuArray(x)
        held = weakref.ref(array)
        work = comm.all_reduce(array, async_op=True)
        del array
        gc.collect()
        alive_while_queued = held() is not None and not work.is_completed()
        work.wait(timeout=10)
        until = time.monotonic() + 10         # the watchdog retires finished operations
        while held() is not None and time.monotonic() < until:
            time.sleep(0.05)
            gc.collect()
        released = held() is None
        calls = comm.flight_recorder.entries()[-5:]   # the five all_reduces
    return {"right": right, "alive_while_queued": alive_while_queued, "released": released,
            "seqs": [e["seq"] - calls[0]["seq"] for e in calls],
            "replayed": [e["replayed"] for e in calls]}


def test_repeated_async_gpu_calls_replay_their_plan_and_hold_their_arrays_until_done():
    for got in run_ranks(check_async_replays, 2, env=SETUP):
        assert got["right"] == [True] * 4, got["right"]
        # the first call plans (it may replay a plan an earlier check left for an array at the
        # same address, which is the same call); every later one replays it
        assert got["replayed"][1:] == [True] * 4, got["replayed"]
        assert got["alive_while_queued"], "a replayed async call let its array go while queued"
        assert got["released"], "a finished async call kept its array alive"
        assert got["seqs"] == list(range(5)), got["seqs"]


def check_keep_alive(comm) -> dict[str, bool]:
    """The GPU engine's one keep-alive: a queued operation holds the arrays it was given, whose
    last reference the caller dropped, until it is done, and lets them go then; neither the
    backend's queued function nor a plan made from it keeps them (they get bare arrays)."""
    import gc
    import threading
    import weakref

    def gone(ref: weakref.ref) -> bool:
        return eventually(lambda: gc.collect() >= 0 and ref() is None, timeout_s=10)

    out = {}
    with _as_torch_tensors():
        for name, async_op, count in (("async", True, 11), ("blocking", False, 13)):
            gate = threading.Event()
            launch(DEVICE, 0, lambda gate=gate: gate.wait(10))   # the caller's stream waits
            # a size no other check uses: this call takes the full path (and plans)
            array = FakeGpuArray(np.full(count, float(comm.rank)))
            ref = weakref.ref(array)
            # (a blocking call returns the array: not kept here; it leaves a plan)
            work = comm.all_reduce(array, async_op=True) if async_op else \
                comm.all_reduce(array) and None
            del array
            out[f"{name} held while queued"] = ref() is not None
            out[f"{name} took the full path"] = not comm.flight_recorder.entries()[-1]["replayed"]
            gate.set()
            if work is not None:
                work.wait(timeout=10)
            _landed()
            out[f"{name} let go once done"] = gone(ref)
    return out


def test_a_queued_gpu_operation_holds_its_arrays_until_done_and_nothing_else_does():
    for got in run_ranks(check_keep_alive, 2, env=SETUP):
        assert all(got.values()), got


def check_uneven_calls_leave_no_plan(comm) -> tuple[list[bool], list[bool]]:
    """Repeated blocking uneven calls on the same arrays, with plans being kept: each is right
    (its queued function holds scratch of its own, given back after one use: never a plan)."""
    n, r = comm.size, comm.rank
    mine = np.full(r + 1, float(r), np.float32)
    outs = [np.zeros(j + 1, np.float32) for j in range(n)]
    right = []
    with _as_torch_tensors():
        comm.all_reduce(FakeGpuArray(np.zeros(2, np.float32)))  # plans are kept from now on
        for step in range(3):
            mine[...] = r + 10 * step
            comm.all_gather([FakeGpuArray(o) for o in outs], FakeGpuArray(mine))
            _landed()
            right.append(all((o == j + 10 * step).all() for j, o in enumerate(outs)))
        gathers = [e for e in comm.flight_recorder.entries() if e["op"] == "all_gather"][-3:]
        return right, [e["replayed"] for e in gathers]


def test_repeated_uneven_gpu_calls_take_the_full_path_each_time():
    for right, replayed in run_ranks(check_uneven_calls_leave_no_plan, 2, env=SETUP):
        assert right == [True] * 3, right
        assert replayed == [False] * 3, replayed


# ---- ordering --------------------------------------------------------------------------------
def check_async_ordering(comm) -> tuple[bool, bool, bool]:
    from anyccl import gpu

    n = comm.size
    stream = gpu.new_stream(0)
    x = np.zeros(20_000)
    # the producer: a slow kernel on the caller's stream writes the input
    launch(DEVICE, stream, lambda: (time.sleep(0.2), x.__setitem__(slice(None), comm.rank + 1.0)))
    work = comm.all_reduce(FakeGpuArray(x, stream), async_op=True)
    early = work.is_completed()
    work.wait()                     # the caller's stream waits; the host does not
    seen: list[np.ndarray] = []
    launch(DEVICE, stream, lambda: seen.append(x.copy()))  # the consumer, after wait()
    gpu.synchronize_stream(stream)
    expected = n * (n + 1) / 2
    return (not early, bool((seen[0] == expected).all()), work.is_completed())


def test_async_ops_run_after_the_producers_stream_and_wait_orders_the_consumer():
    for not_early, consumer_saw_result, completed in run_ranks(check_async_ordering, 2,
                                                                env=SETUP):
        assert not_early, "the operation completed before the producer's kernel ran"
        assert consumer_saw_result, "work queued after Work.wait() ran before the result"
        assert completed


def check_blocking_returns_before_the_gpu_finishes(comm) -> tuple[float, bool]:
    from anyccl import gpu

    stream = gpu.new_stream(0)
    x = np.zeros(1000)
    launch(DEVICE, stream, lambda: (time.sleep(0.5), x.__setitem__(slice(None), 1.0)))
    start = time.monotonic()
    comm.all_reduce(FakeGpuArray(x, stream))   # queued on the caller's stream itself
    returned_after = time.monotonic() - start
    gpu.synchronize_stream(stream)
    return returned_after, bool((x == comm.size).all())


def test_a_blocking_call_is_queued_on_the_callers_stream_without_blocking_the_host():
    for returned_after, right in run_ranks(check_blocking_returns_before_the_gpu_finishes, 2,
                                           env=SETUP):
        assert returned_after < 0.4, f"the host waited {returned_after:.2f} s for the GPU"
        assert right


# ---- cached plans of repeated blocking calls --------------------------------------------------
@contextlib.contextmanager
def _as_torch_tensors() -> Iterator[None]:
    """Have plans take FakeGpuArrays for torch CUDA tensors on the default stream."""
    from anyccl import plans

    saved = plans.cuda_tensor_key, plans.torch_stream_function
    plans.cuda_tensor_key = lambda x: ((x.a.ctypes.data, x.a.size, x.a.dtype.str)
                                       if isinstance(x, FakeGpuArray) and not x.stream else None)
    plans.torch_stream_function = lambda: (lambda device: 0)
    try:
        yield
    finally:
        plans.cuda_tensor_key, plans.torch_stream_function = saved


def check_plans(comm) -> dict[str, Any]:
    with _as_torch_tensors():
        return _plans(comm)


def _plans(comm) -> dict[str, Any]:
    n, r = comm.size, comm.rank
    x, whole, mine = np.zeros(4, np.float32), np.zeros(4 * n, np.float32), np.zeros(4, np.float32)
    gathered = [np.zeros(4, np.float32) for _ in range(n)]
    results = []
    for step in range(4):   # the first call checks and plans, the next ones replay
        x[...] = r + step
        comm.all_reduce(FakeGpuArray(x))
        comm.all_gather(FakeGpuArray(whole), FakeGpuArray(x))
        comm.broadcast(FakeGpuArray(x), 1)
        _landed()
        mine[...] = x + r
        comm.gather(FakeGpuArray(mine), [FakeGpuArray(g) for g in gathered] if r == 0 else None)
        _landed()
        results.append((x.copy(), whole.copy(), [g.copy() for g in gathered]))
    calls = comm.flight_recorder.entries()[-16:]   # 4 steps x 4 operations
    first = calls[0]["seq"]
    replayed = [e["replayed"] for e in calls]
    refused = []
    for call in (lambda: comm.broadcast(FakeGpuArray(x), True),       # 1 as a bool: refused
                 lambda: comm.all_reduce(FakeGpuArray(x), op="nonsense"),
                 lambda: comm.all_gather(FakeGpuArray(whole[:-1]), FakeGpuArray(x))):
        try:
            call()
        except anyccl.AnycclError as exc:
            refused.append(str(exc))
    def ours() -> list[dict]:
        return [e for e in comm.flight_recorder.entries() if e["seq"] >= first]
    eventually(lambda: not {e["state"] for e in ours()} & {"queued", "started"})  # retired
    ours = ours()
    seqs = [e["seq"] - first for e in ours]
    states = {e["state"] for e in ours}
    return {"results": results, "replayed": replayed, "refused": refused, "seqs": seqs,
            "states": states}


def test_repeated_blocking_gpu_calls_replay_their_plan_with_every_check_and_record_kept():
    n = 2
    for r, got in enumerate(run_ranks(check_plans, n, env=SETUP)):
        for step, (x, whole, gathered) in enumerate(got["results"]):
            total = sum(q + step for q in range(n))
            assert (x == total).all(), (r, step, x)           # broadcast of rank 1's sum
            assert (whole == np.repeat([total] * n, 4)).all(), (r, step, whole)
            if r == 0:
                assert [g[0] for g in gathered] == [total + q for q in range(n)], gathered
        assert got["replayed"][4:] == [True] * 12   # steps 2-4 replay each operation's plan
        assert len(got["refused"]) == 3, got["refused"]
        assert "src=True must be an int rank" in got["refused"][0]
        assert "nonsense" in got["refused"][1]
        assert "out has 7 elements; expected 2 x 4 = 8" in got["refused"][2]
        assert got["seqs"] == list(range(16)), got["seqs"]   # every replay numbered
        assert got["states"] == {"done"}


def check_retiring_without_the_watchdog(comm) -> dict:
    from anyccl.backends import gpu_queue

    gpu_queue._WATCH_POLL_S = 3600.0           # the watchdog sleeps through the whole loop
    x = FakeGpuArray(np.ones(2, np.float32))
    comm.all_reduce(x)                         # wakes the watchdog, which now sleeps an hour
    _landed()
    queue = comm.gpu_backend.queue
    longest = 0
    for step in range(6 * gpu_queue._RETIRE_EVERY):
        comm.all_reduce(x)
        if step % 16 == 15:
            _landed()                          # what was queued so far has finished
        longest = max(longest, len(queue._queued))
    _landed()
    states = [e["state"] for e in comm.flight_recorder.entries()]
    return {"longest": longest, "states": states[:len(states) - len(queue._queued)]}


def test_an_eager_loop_retires_its_finished_operations_itself():
    """Operations are retired (flight records marked done, arrays released) by the caller every
    64 calls, not only by the watchdog's polls: thousands of records queued between two polls
    lived long enough to set off the garbage collector's full collections in eager loops."""
    from anyccl.backends.gpu_queue import _RETIRE_EVERY

    got = run_ranks(check_retiring_without_the_watchdog, 1, env=SETUP)[0]
    assert got["longest"] <= 2 * _RETIRE_EVERY, got["longest"]
    assert got["states"] and set(got["states"]) == {"done"}, got["states"]  # not queued


# ---- error paths ---------------------------------------------------------------------------
def check_argument_errors(comm) -> list[str]:
    errors = []
    host, device = np.zeros(4), FakeGpuArray(np.zeros(4))
    for call in (lambda: comm.all_gather(FakeGpuArray(np.zeros(8)), host),
                 lambda: comm.all_reduce(host, stream=3),
                 lambda: comm.all_reduce(FakeGpuArray(np.zeros(4, np.complex64)),
                                         op=anyccl.ReduceOp.MAX)):
        try:
            call()
        except anyccl.AnycclError as exc:
            errors.append(str(exc))
    comm.all_reduce(device)  # and the communicator is still usable
    _landed()
    return errors


def test_bad_gpu_arguments_are_refused_before_anything_is_queued():
    errors = run_ranks(check_argument_errors, 2, env=SETUP)[0]
    assert len(errors) == 3
    assert "is a GPU array but tensor is in host memory" in errors[0]
    assert "stream= applies to GPU arrays only" in errors[1]
    assert "complex64" in errors[2] and "MAX" in errors[2]


def check_deadline(comm) -> str:
    if comm.rank == 1:
        return "stayed away"
    comm.all_reduce(FakeGpuArray(np.ones(4)))   # rank 1 never joins
    time.sleep(2.5)
    try:
        comm.all_reduce(FakeGpuArray(np.ones(4)))
    except anyccl.TimeoutError as exc:
        return str(exc)
    return "no error"


def test_a_gpu_operation_past_its_deadline_aborts_the_queue_and_the_next_call_raises():
    env = {**SETUP, "ANYCCL_TIMEOUT": "1"}
    message, _ = run_ranks(check_deadline, 2, env=env)
    assert message.startswith("rank 0: all_reduce(float64 x 4, op=SUM) #1 did not finish on "
                              "GPU 0 within"), message
    assert "the fake GPU communicator was aborted" in message


def check_lost_peer(comm, report: str) -> str:
    import os
    import signal

    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    message = "not lost"
    try:
        for _ in range(100):
            comm.all_reduce(FakeGpuArray(np.ones(4)))
            time.sleep(0.1)
    except anyccl.PeerLostError as exc:
        message = str(exc)
    with open(report, "w") as f:
        f.write(message)
    return message


def test_a_peer_that_dies_aborts_the_gpu_queue_with_peer_lost(tmp_path):
    report = tmp_path / "rank0.txt"
    with pytest.raises(AssertionError, match="rank 1 died"):  # the harness sees rank 1 go
        run_ranks(check_lost_peer, 2, str(report), env={**SETUP, "ANYCCL_TIMEOUT": "30"})
    message = report.read_text()
    assert message.startswith("rank 0: rank 1 (pid "), message
    assert "died" in message and "the fake GPU communicator was aborted" in message
