"""What the ipc backend queues for each operation, checked without a GPU: the kernel launches
(recorded instead of made) cover every element exactly once, in rounds no larger than the
buffers, with tiles and blocks the kernels can flag; what the kernels do not serve goes to NCCL;
batched messages fork to side streams and join back. The kernels themselves are tested on GPUs
(tests/test_gpu_ipc.py)."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from anyccl import ReduceOp, gpu
from anyccl.backends.gpu_queue import GpuQueue
from anyccl.backends.ipc import backend as ipc
from anyccl.backends.ipc import compiler
from anyccl.backends.ipc.memory import THREADS, TILE_BYTES, KernelArgs, Layout
from anyccl.backends.ipc.routes import Routes
from anyccl.buffers import BFLOAT16, GpuArray
from anyccl.errors import AnycclError, CommunicatorClosedError
from anyccl.trace import OpRecord


class FakeNccl:
    """Stands for the NCCL side: each op returns a tag naming itself."""

    def __init__(self, rank, size):
        self.rank, self.size, self.device = rank, size, 0
        self.queue = Watched()

    def __getattr__(self, op):
        return lambda *args, **kwargs: ("nccl", op)

    def group(self, calls):
        return lambda stream: [call(stream) for call in calls]


class Watched:
    """The NCCL side's queue, as far as the ipc backend sees it: what it is told to watch."""

    def watch(self, **kinds):
        self.kinds = kinds


class FakeMemory:
    """What the ipc backend reads of its peer memory (memory.py): the layout and the addresses
    the kernels' argument block starts from, none of them dereferenced here."""

    def __init__(self, layout, rank, size):
        self.layout, self.rank, self.size = layout, rank, size
        self.datas, self.sigs = [1 << 40] * size, [1 << 41] * size
        self.status_device = 0
        self.status = (ctypes.c_uint64 * 8)()

    def aborted(self):
        return False


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch as (kernel, blocks, stream, copy of the argument fields)."""
    seen = []
    names = {}

    def launch(function, blocks, threads, stream, params):
        # what the kernel would get: the block the parameter array points to
        args = KernelArgs.from_address(ctypes.c_void_p.from_address(params).value)
        fields = {name: getattr(args, name) for name, _ in KernelArgs._fields_}
        fields["ins"], fields["outs"] = list(args.ins), list(args.outs)
        seen.append((names[function], blocks, stream, fields))
        assert threads == ipc.THREADS

    monkeypatch.setattr(gpu, "launch", launch)
    events = []
    monkeypatch.setattr(gpu, "record", lambda e, s: events.append(("record", e, s)))
    monkeypatch.setattr(gpu, "stream_wait", lambda s, e: events.append(("wait", s, e)))
    counter = iter(range(100, 10_000))
    monkeypatch.setattr(gpu, "new_stream", lambda d: next(counter))
    monkeypatch.setattr(gpu, "new_event", lambda d: next(counter))
    backend_under_test.clear()
    return seen, names, events


backend_under_test: list = []


def make_backend(names, size=2, rank=0, policy="ipc", half_mb=2, routes=None, tuned=False):
    """The ipc backend, made by its constructor over the fakes above, with the kernels named
    as `names` maps their handles, and the thresholds these tests were written for (the ipc
    policy's routes from them, unless `routes` are given; tuned=True: the tuning table's)."""
    import os

    os.environ["ANYCCL_IPC_HALF_MB"] = str(half_mb)
    try:
        layout = Layout(size)
    finally:
        del os.environ["ANYCCL_IPC_HALF_MB"]
    kernels = {name: i for i, name in enumerate(compiler.kernel_names())}
    names.update({i: name for name, i in kernels.items()})
    real = compiler.kernels
    compiler.kernels = lambda device: kernels
    try:
        b = ipc.IpcBackend(FakeNccl(rank, size), FakeMemory(layout, rank, size), policy,
                           routes)
    finally:
        compiler.kernels = real
    if tuned:
        backend_under_test.append(b)
        return b
    b.max_blocks, b.ll_bytes, b.one_shot_bytes = 128, min(16 << 10, layout.slot_bytes // 2), \
        256 << 10
    b.ce_bytes = 1 << 62  # the copy-engine path: tests/test_ipc_copy_engines.py
    if routes is None:
        b.routes = Routes.kernels(b.ll_bytes, b.one_shot_bytes, b.ce_bytes, "test")
    backend_under_test.append(b)
    return b


def arr(ptr, count, dtype=np.float32):
    return GpuArray(ptr, count, np.dtype(dtype), 0, 0, "test", None)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_the_one_shot_lines_end_where_every_rank_pushes_what_two_ranks_push_at_ll_max(
        launches, size):
    _, names, _ = launches
    b = make_backend(names, size=size, half_mb=256, tuned=True)
    ll_max = 1 << 20                                    # the tuning table's default
    want = ll_max if size == 2 else ll_max // (size - 1)
    assert b.ll_bytes == min(want, b.layout.slot_bytes // 2)
    assert b.routes.pick("all_reduce", b.ll_bytes) == "low_latency"
    after = b.routes.pick("all_reduce", b.ll_bytes + 4)
    assert after == ("one_shot" if size == 2 else "low_latency_two_shot")


@pytest.mark.parametrize("count", [1, 4096, 4097, 65536, 131072 + 7, 524288, 2_000_003])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16])
def test_all_reduce_rounds_cover_every_element_once_within_the_buffers(launches, count, dtype):
    seen, names, _ = launches
    b = make_backend(names)
    x = arr(1 << 20, count, dtype)
    b.all_reduce(x, ReduceOp.AVG)(7)
    size, slot = x.dtype.itemsize, b.layout.slot_bytes
    covered = 0
    for kernel, blocks, stream, a in seen:
        assert stream == 7 and a["scale"] == 0.5 and 1 <= blocks <= b.max_blocks
        assert a["inp"] == a["out"] == x.ptr + covered * size      # rounds in order, no gap
        nbytes = a["count"] * size
        if kernel.startswith("all_reduce_low_latency"):             # data+flag words
            assert len(seen) == 1 and 2 * nbytes <= slot and nbytes <= b.ll_bytes
        elif kernel.startswith("all_reduce_one_shot"):              # one shot: all in a slot
            assert nbytes <= min(slot, b.one_shot_bytes)
            assert a["ins"][:2] == [a["inp"]] * 2                   # every piece: the array
        else:                                                       # two shots: a segment
            assert kernel.startswith("all_reduce_two_shot")
            assert -(-a["count"] // 2) * size <= slot
        if not kernel.startswith("all_reduce_low_latency"):
            tile = a["tile_bytes"]
            assert b.tile_min <= tile <= b.layout.tile_bytes and tile % b.tile_min == 0
            per_block = nbytes if kernel.startswith("all_reduce_one_shot") else \
                -(-a["count"] // 2) * size
            assert -(-per_block // tile) <= b.layout.max_tiles       # every tile has a flag
        covered += a["count"]
    assert covered == count


@pytest.mark.parametrize("size", [2, 3, 4, 8])
@pytest.mark.parametrize("algorithm", ["low_latency", "low_latency_two_shot", "one_shot",
                                       "two_shot"])
@pytest.mark.parametrize("count", [1, 7, 1023, 65536 + 3, 700_001])
def test_each_all_reduce_algorithm_a_route_names_covers_every_element_once_on_any_rank_count(
        launches, size, algorithm, count):
    seen, names, _ = launches
    b = make_backend(names, size=size, routes=Routes.everywhere("all_reduce", algorithm))
    x = arr(1 << 20, count)
    b.all_reduce(x, ReduceOp.SUM)(3)
    slot = b.layout.slot_bytes
    covered = 0
    lines = -(-4 * count // 8)                          # 8 bytes of data in 16
    fits_ll = lines * 16 <= slot
    fits_ll2 = -(-lines // size) * 16 <= slot           # each rank's segment of lines
    for kernel, blocks, on, a in seen:
        assert on == 3 and a["inp"] == a["out"] == x.ptr + covered * 4 and a["scale"] == 1.0
        nbytes = a["count"] * 4
        if algorithm == "low_latency" and fits_ll:      # one kernel of lines, a line a thread
            assert kernel == "all_reduce_low_latency_float32_sum" and len(seen) == 1
            assert blocks == min(b.max_blocks, -(-lines // THREADS))
        elif algorithm == "low_latency_two_shot" and fits_ll2:
            assert kernel == "all_reduce_low_latency_two_shot_float32_sum" and len(seen) == 1
            segment = -(-lines // size)
            assert blocks == min(b.max_blocks, -(-segment // THREADS))
        elif kernel.startswith("all_reduce_one_shot"):   # the chosen one, or the last piece
            assert algorithm != "two_shot" or nbytes <= min(slot, b.one_shot_bytes)
            assert nbytes <= slot and a["ins"][:size] == [a["inp"]] * size
        else:
            assert kernel == "all_reduce_two_shot_float32_sum"
            assert algorithm in ("two_shot", "low_latency_two_shot")
            assert -(-a["count"] // size) * 4 <= slot    # each rank's segment fits a slot
        assert 1 <= blocks <= b.max_blocks
        covered += a["count"]
    assert covered == count


@pytest.mark.parametrize("takers", [0, 1, 16, 127, 128, 300])
@pytest.mark.parametrize("nbytes", [4, TILE_BYTES, 3 * TILE_BYTES + 1, 8 << 20, 33 << 20])
def test_a_kernels_blocks_split_into_pushers_with_a_tile_each_and_at_most_as_many_takers(
        launches, takers, nbytes):
    _, names, _ = launches
    b = make_backend(names)
    b.takers = takers
    blocks, tile, taking = b._tiling(nbytes)
    tiles = -(-nbytes // tile)
    pushers = blocks - taking
    assert 1 <= pushers <= tiles and blocks <= b.max_blocks     # every pusher has a tile
    assert b.tile_min <= tile <= b.layout.tile_bytes and tile % b.tile_min == 0
    if 0 < takers < b.max_blocks:
        assert taking == min(takers, tiles)                         # a taker has a tile too
    else:
        assert taking == 0                                          # none, or none left to push
    b.all_gather([arr((1 << 32) + q * (1 << 28), nbytes, np.uint8) for q in range(2)],
                 arr(1 << 36, nbytes, np.uint8))(0)               # the kernels are told
    first = b._tiling(min(nbytes, b.layout.slot_bytes))          # (a round fills a slot)
    assert launches[0][0][1] == first[0] and launches[0][0][3]["takers"] == first[2]


@pytest.mark.parametrize("tile_min", [1 << 10, 4 << 10, 48 << 10, TILE_BYTES])
@pytest.mark.parametrize("nbytes", [4, 5000, 256 << 10, 1 << 20, 8 << 20])
def test_small_tiles_spread_a_small_array_over_more_blocks_and_every_tile_keeps_its_flag(
        launches, tile_min, nbytes):
    _, names, _ = launches
    b = make_backend(names, half_mb=64)
    b.tile_min = min(TILE_BYTES, 1 << (tile_min.bit_length() - 1))   # as the backend reads it
    blocks, tile, _ = b._tiling(nbytes)
    tiles = -(-nbytes // tile)
    assert tiles <= b.layout.max_tiles                               # every tile has a flag
    assert tile % b.tile_min == 0 and tile <= b.layout.tile_bytes
    assert blocks == min(b.max_blocks, tiles)                        # a block for each tile
    b.tile_min = TILE_BYTES
    wide, _, _ = b._tiling(nbytes)
    assert blocks >= wide                                            # never fewer blocks


def test_reduce_scatter_and_all_gather_address_every_piece_in_each_round(launches):
    seen, names, _ = launches
    b = make_backend(names)
    per = (b.layout.slot_bytes // 4) * 2 + 5                       # three rounds
    pieces = [arr((1 << 30) + q * (1 << 28), per) for q in range(2)]
    out = arr(1 << 40, per)
    b.reduce_scatter(out, pieces, ReduceOp.SUM)(0)
    starts = [0]
    for kernel, _, _, a in seen:
        assert kernel == "reduce_scatter_float32_sum"
        assert a["ins"][:2] == [p.ptr + starts[-1] * 4 for p in pieces]
        assert a["out"] == out.ptr + starts[-1] * 4 and a["count"] * 4 <= b.layout.slot_bytes
        starts.append(starts[-1] + a["count"])
    assert len(seen) == 3 and starts[-1] == per
    seen.clear()
    outs = [arr((1 << 32) + q * (1 << 28), per) for q in range(2)]
    b.all_gather(outs, arr(1 << 36, per))(0)
    done = 0
    for kernel, _, _, a in seen:
        assert kernel == "all_gather" and a["outs"][:2] == [o.ptr + done for o in outs]
        done += a["count"]
    assert done == per * 4                                           # bytes


def test_what_the_kernels_do_not_serve_goes_to_nccl(launches):
    _, names, _ = launches
    b = make_backend(names)
    assert b.all_reduce(arr(4096, 10, np.int32), ReduceOp.SUM) == ("nccl", "all_reduce")
    assert b.all_reduce(arr(4096, 10), ReduceOp.PROD) == ("nccl", "all_reduce")
    assert b.reduce(arr(4096, 10), 0, ReduceOp.SUM) == ("nccl", "reduce")
    assert b.all_to_all([arr(0, 1)] * 2, [arr(8, 1)] * 2) == ("nccl", "all_to_all")
    table = Routes({"broadcast": [(0, 8 << 20, "kernels")]}, "test table")
    auto = make_backend(names, policy="auto", routes=table)
    assert (b.name, auto.name) == ("ipc", "auto")  # what comm.backend reports: cuda:ipc / :auto
    assert auto.broadcast(arr(4096, 16 << 18), 0) == ("nccl", "broadcast")   # 16 MiB
    assert callable(auto.broadcast(arr(4096, 1 << 10), 0))                  # 4 KiB: kernels
    assert auto.all_reduce(arr(4096, 10), ReduceOp.SUM) == ("nccl", "all_reduce")  # no route


def test_batched_messages_fork_to_a_side_stream_per_channel_and_join_back(launches):
    seen, names, events = launches
    b = make_backend(names)
    x = arr(4096, 1 << 20)
    calls = [b.send(x, 1, tag=5), b.recv(x, 1, tag=5), b.send(x, 1, tag=6)]
    b.group(calls)(42)
    sides = list(dict.fromkeys(stream for _, _, stream, _ in seen))
    assert len(sides) == 2 and 42 not in sides                       # (send, 1) and (recv, 1)
    kind, fork, stream = events[0]                                   # the fork: an event on
    assert (kind, stream) == ("record", 42)                          # the caller's stream,
    assert all(("wait", side, fork) in events for side in sides)     # that each side waits for
    assert [stream for _, _, stream, _ in seen] == [sides[0], sides[1], sides[0]]
    assert [a["tag"] for *_, a in seen] == [5, 5, 6]
    joins = [e for e in events if e[0] == "wait" and e[1] == 42]
    assert len(joins) == 2                                           # the stream waits for both


def test_a_one_kernel_operation_is_queued_in_one_step_after_the_queues_last_operation(
        launches, monkeypatch):
    """A blocking operation of one kernel (what a cached plan replays) carries its own
    argument block, so the queue issues its driver calls as one (gpu.queue_kernel): wait for
    the queue's previous operation if that ran on another stream, launch, record its event; on
    a stream being captured it is captured whole, with no event. A cached plan's blocking
    replay (`replay_one`) takes the same steps."""
    seen, names, events = launches
    monkeypatch.setattr(gpu, "_core", None)   # the per-call path: each driver call is seen
    record_launch = gpu.launch
    monkeypatch.setattr(gpu, "launch", lambda function, blocks, threads, stream, params: (
        events.append(("launch", stream)), record_launch(function, blocks, threads, stream,
                                                          params)))
    capturing: set[int] = set()
    monkeypatch.setattr(gpu, "is_capturing", lambda stream: stream in capturing)
    monkeypatch.setattr(gpu, "ensure_context", lambda device: None)
    queue = GpuQueue(0, "rank 0", lambda: None, rank=0)
    queue._wake_watchdog = lambda: None   # no watchdog thread: what it would follow is kept
    b = make_backend(names)
    x = arr(1 << 20, 2)
    call = b.all_reduce(x, ReduceOp.AVG)
    assert type(call) is gpu.KernelLaunch
    b.all_reduce(arr(1 << 21, 2), ReduceOp.SUM)(5)   # another operation's arguments differ...
    events.clear()
    seen.clear()
    deadline = time.monotonic() + 60
    before = queue.run(OpRecord("async", 1), [7], deadline, lambda stream: None, None, [])
    events.clear()
    first = queue.run(OpRecord("all_reduce", 2), [7], deadline, call, None, [], on=7)
    second = queue.run(OpRecord("all_reduce", 3), [7], deadline, call, None, [], on=7)
    assert events == [("wait", 7, before), ("launch", 7), ("record", first, 7),
                      ("launch", 7), ("record", second, 7)]
    assert first != second and [item[1] for item in queue._queued] == [before, first, second]
    for kernel, _, stream, a in seen:     # ...but not this one's
        assert kernel == "all_reduce_low_latency_float32_sum" and stream == 7
        assert (a["inp"], a["out"], a["count"], a["scale"]) == (x.ptr, x.ptr, 2, 0.5)
    replayed = OpRecord("all_reduce", 5)   # a cached plan's blocking replay: the same steps
    events.clear()
    queue.replay_one(replayed, call, gpu.queue_kernel, 7, deadline)
    third = queue._queued[-1][1]
    assert events == [("launch", 7), ("record", third, 7)] and third not in (first, second)
    assert queue._queued[-1][0] is replayed and replayed.state == "started"
    capturing.add(9)
    events.clear()
    assert queue.run(OpRecord("all_reduce", 4), [9], deadline, call, None, [], on=9) == 0
    assert events == [("launch", 9)]      # in the graph; the queue follows nothing of it
    events.clear()
    queue.replay_one(OpRecord("all_reduce", 6), call, gpu.queue_kernel, 9, deadline)
    assert events == [("launch", 9)]
    assert len(queue._queued) == 4


def test_a_kernel_that_ended_early_fails_the_next_call_before_it_queues(launches, monkeypatch):
    """The ipc kernels' status word is the queue's alarm: once a kernel set it (a message with
    the wrong tag), the next call runs the health checks at once, raises what they found and
    queues nothing; later calls say the communicator was aborted on it."""
    seen, names, events = launches
    monkeypatch.setattr(gpu, "_core", None)
    monkeypatch.setattr(gpu, "is_capturing", lambda stream: False)
    monkeypatch.setattr(gpu, "ensure_context", lambda device: None)
    words = (ctypes.c_uint64 * 8)()
    aborted = []
    queue = GpuQueue(0, "rank 0", lambda: None, rank=0)
    queue._wake_watchdog = lambda: None
    queue.watch(health=lambda record: AnycclError(f"{record}: the message carries tag 3")
                if words[1] else None, abort=lambda: aborted.append(True), alarm=(words, 1))
    call = make_backend(names).all_reduce(arr(1 << 20, 2), ReduceOp.SUM)
    deadline = time.monotonic() + 60
    queue.run(OpRecord("recv", 1), [7], deadline, call, None, [], on=7)
    assert len(seen) == 1 and not aborted
    words[1] = 1                                     # the kernel ended its operation early
    with pytest.raises(AnycclError, match=r"recv\(\) #1: the message carries tag 3"):
        queue.run(OpRecord("all_reduce", 2), [7], deadline, call, None, [], on=7)
    assert len(seen) == 1 and aborted == [True]     # nothing more queued; kernels told to stop
    with pytest.raises(CommunicatorClosedError, match="aborted on an earlier error"):
        queue.run(OpRecord("all_reduce", 3), [7], deadline, call, None, [], on=7)
