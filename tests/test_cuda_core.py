"""The compiled CUDA driver calls (`anyccl/_cudacore.c`): built by `pip install -e .` on any
machine (it opens the driver library at run time), refusing calls until it has loaded, and, on a
GPU, answering every call as NVIDIA's bindings do (gpu.py uses it in their place)."""

from __future__ import annotations

import ctypes
import itertools
import threading
import time

import pytest

from anyccl import gpu

_cudacore = pytest.importorskip("anyccl._cudacore", reason="the CUDA core was not built here")


def test_the_module_builds_everywhere_and_gpu_uses_it_only_where_the_driver_opens():
    loaded = _cudacore.load()
    assert loaded == (gpu._core is not None)
    if not loaded:  # no driver library: every GPU call stays on the bindings
        with pytest.raises(RuntimeError, match="load"):
            _cudacore.record(1, 2)


def test_wrong_argument_counts_are_refused_by_name():
    with pytest.raises(TypeError, match=r"launch\(\) takes 5 arguments \(2 given\)"):
        _cudacore.launch(1, 2)
    with pytest.raises(TypeError, match=r"record\(\) takes 2 arguments \(1 given\)"):
        _cudacore.record(1)
    with pytest.raises(TypeError, match=r"follow\(\) takes 3 arguments \(2 given\)"):
        _cudacore.follow(1, 2)
    with pytest.raises(TypeError, match=r"queue_nccl\(\) takes 12 arguments \(7 given\)"):
        _cudacore.queue_nccl(1, 2, 3, 4, 5, 6, 7)


def test_the_compiled_replay_takes_only_its_context_and_declines_where_no_driver_loaded():
    with pytest.raises(TypeError, match=r"replay\(\) takes 3 arguments \(2 given\)"):
        _cudacore.replay(1, 2)
    with pytest.raises(TypeError, match="a context tuple"):
        _cudacore.replay((), ("all_reduce",), object())
    if gpu._core is None:   # nothing is looked at: the Python way takes every call
        context = ({},) + (None,) * 9
        assert _cudacore.replay(context, ("all_reduce",), object()) is False


def test_the_plans_build_the_context_the_compiled_replay_takes(monkeypatch):
    torch = pytest.importorskip("torch")
    from anyccl import ReduceOp
    from anyccl.plans import Plans

    monkeypatch.setattr(gpu, "_core", _cudacore)   # as where the driver loaded
    replay = Plans().compiled(lambda: 1, lambda record: None, object())
    assert replay is not None
    # no plan for this tensor (and, without a driver, none looked for): the Python way
    assert replay(("all_reduce", ReduceOp.SUM), torch.zeros(2)) is False


def test_without_the_core_follow_records_then_waits(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu, "_core", None)
    monkeypatch.setattr(gpu, "record", lambda event, stream: calls.append(("record", event,
                                                                           stream)))
    monkeypatch.setattr(gpu, "stream_wait", lambda stream, event: calls.append(("wait", stream,
                                                                                event)))
    gpu.follow(stream=11, event=22, after=33)
    assert calls == [("record", 22, 33), ("wait", 11, 22)]


def test_a_replayed_nccl_collective_is_queued_in_one_compiled_call(monkeypatch):
    """What the nccl backend hands a plan where NCCL's entry point is known (gpu.NcclCall): a
    replay on the caller's stream gives the compiled core the stream, NCCL's function, its
    arguments (with_op 0 and no op for ncclAllGather), the event to record and the queue's
    previous event to wait for, in one call; NCCL's failure there is NCCL's error, named with
    the operation; on a stream being captured nothing is queued there and the call goes
    through the bindings into the graph."""
    from anyccl.backends.gpu_queue import GpuQueue
    from anyccl.errors import AnycclError
    from anyccl.trace import OpRecord

    class NcclError(Exception):
        pass

    def check(code):
        raise NcclError(f"ncclResult_t {code}")

    class Core:
        status, calls = 0, []

        def queue_nccl(self, *args):
            self.calls.append(args)
            return self.status

    counter = itertools.count(100)
    monkeypatch.setattr(gpu, "new_stream", lambda d: next(counter))
    monkeypatch.setattr(gpu, "new_event", lambda d: next(counter))
    monkeypatch.setattr(gpu, "ensure_context", lambda device: None)
    monkeypatch.setattr(gpu, "is_capturing", lambda stream: stream == 9)
    core = Core()
    monkeypatch.setattr(gpu, "_core", core)
    queue = GpuQueue(0, "rank 0", lambda: None, rank=0, enqueue_errors=(NcclError,),
                     describe_error=lambda record, exc: AnycclError(f"{record}: {exc}"))
    queue._wake_watchdog = lambda: None
    through_bindings = []
    reduce = gpu.NcclCall(0xF00, (11, 11, 4, 7, 0, 0xC0), through_bindings.append, check)
    gather = gpu.NcclCall(0xF01, (11, 12, 4, 9, None, 0xC0), through_bindings.append, check)
    deadline = time.monotonic() + 60
    first = queue.run(OpRecord("all_reduce", 1), [7], deadline, reduce, None, [], on=7)
    second = queue.run(OpRecord("all_gather", 2), [8], deadline, gather, None, [], on=8)
    assert core.calls == [(7, 0xF00, 1, 11, 11, 4, 7, 0, 0xC0, first, 0, 0),
                          (8, 0xF01, 0, 11, 12, 4, 9, 0, 0xC0, second, first, 0)]
    assert through_bindings == [] and first != second
    core.status = -(5 * 4 + 2)   # NCCL said ncclInvalidArgument
    with pytest.raises(AnycclError, match=r"all_reduce.*ncclResult_t 5"):
        queue.run(OpRecord("all_reduce", 3), [7], deadline, reduce, None, [], on=7)
    core.status = 1              # the stream is being captured: nothing queued
    assert queue.run(OpRecord("all_reduce", 4), [9], deadline, reduce, None, [], on=9) == 0
    assert through_bindings == [9]


@pytest.fixture
def torch_on_gpu():
    """torch, with GPU 0 current, and the compiled core serving anyccl's driver calls."""
    torch = pytest.importorskip("torch")
    assert _cudacore.load() and gpu._core is _cudacore
    torch.cuda.set_device(0)
    torch.cuda.init()
    return torch


@pytest.mark.gpu
def test_on_a_gpu_each_call_answers_as_the_bindings_do(torch_on_gpu):
    torch = torch_on_gpu
    driver = gpu._drv()
    stream, event, done = gpu.new_stream(0), gpu.new_event(0), gpu.new_event(0)
    followed, done_later = gpu.new_event(0), gpu.new_event(0)
    try:
        assert _cudacore.context() == int(driver.cuCtxGetCurrent()[1])
        assert _cudacore.device() == gpu.current_device() == int(gpu._rt().cudaGetDevice()[1])
        # an event behind a host-blocked stream is not ready, then is
        host, device_ptr = gpu.host_alloc_mapped(4)
        word = ctypes.c_uint32.from_address(host)
        word.value = 0
        try:
            gpu.wait_value(stream, device_ptr, 1)
            gpu.record(event, stream)
            assert not gpu.event_done(event)
            assert int(driver.cuEventQuery(event)[0]) == gpu._NOT_READY
            other = gpu.new_stream(0)
            gpu.stream_wait(other, event)      # `other` now waits too
            gpu.record(done, other)
            later = gpu.new_stream(0)
            gpu.follow(later, followed, stream)   # record and wait in one call
            gpu.record(done_later, later)
            assert not gpu.event_done(done) and not gpu.event_done(done_later)
            word.value = 1
            gpu.synchronize_stream(other)
            gpu.synchronize_stream(later)
            assert gpu.event_done(event) and gpu.event_done(done) and gpu.event_done(done_later)
            gpu.destroy_stream(other)
            gpu.destroy_stream(later)
        finally:
            gpu.host_free(host)
        # capture status, as torch's graph capture sees it
        side = torch.cuda.Stream()
        assert not gpu.is_capturing(side.cuda_stream)
        graph = torch.cuda.CUDAGraph()
        x = torch.zeros(4, device="cuda")
        with torch.cuda.graph(graph, stream=side):
            assert gpu.is_capturing(side.cuda_stream)
            x += 1
        assert not gpu.is_capturing(side.cuda_stream)
        # a failed call is an error that names it
        with pytest.raises(gpu.CudaError, match="cuLaunchKernel failed"):
            gpu.launch(0, 1, 32, stream, 0)
        with pytest.raises(gpu.CudaError, match="cuEventRecord failed"):
            gpu.follow(stream, 0, stream)
    finally:
        for e in (event, done, followed, done_later):
            gpu.destroy_event(e)
        gpu.destroy_stream(stream)


class _Put(ctypes.Structure):
    """The argument block of the test kernel `put`: store `value` at `word`."""

    _fields_ = [("word", ctypes.c_uint64), ("value", ctypes.c_uint32)]


_PUT = """
struct Put { unsigned* word; unsigned value; };
extern "C" __global__ void put(Put a) { *(volatile unsigned*)a.word = a.value; }
"""


@pytest.mark.gpu
def test_on_a_gpu_a_kernel_is_queued_after_an_event_and_recorded_in_one_call(torch_on_gpu):
    from anyccl.backends.ipc import compiler

    torch = torch_on_gpu
    major, minor = gpu.compute_capability(0)
    function = gpu.module_function(gpu.load_module(compiler._compile(_PUT, f"sm_{major}{minor}")),
                                   "put")
    host, device_ptr = gpu.host_alloc_mapped(8)
    gate, out = ctypes.c_uint32.from_address(host), ctypes.c_uint32.from_address(host + 4)
    gate.value = out.value = 0
    blocked, stream = gpu.new_stream(0), gpu.new_stream(0)
    opened, done = gpu.new_event(0), gpu.new_event(0)
    try:
        gpu.wait_value(blocked, device_ptr, 1)     # `blocked` waits for the host's word
        gpu.record(opened, blocked)
        call = gpu.KernelLaunch(function, 1, 1, _Put(device_ptr + 4, 7))
        assert gpu.queue_kernel(call, stream, done, opened, 0)
        time.sleep(0.05)
        assert out.value == 0 and not gpu.event_done(done)   # it waits for `opened`
        gate.value = 1
        gpu.synchronize_stream(stream)
        assert out.value == 7 and gpu.event_done(done)       # ran, then its event
        # a thread that never used CUDA: it gets the device's context, then the kernel runs
        out.value = 0
        queued: list[bool] = []
        thread = threading.Thread(target=lambda: queued.append(
            gpu.queue_kernel(call, stream, done, 0, 0)))
        thread.start()
        thread.join()
        gpu.synchronize_stream(stream)
        assert queued == [True] and out.value == 7
        # a null stream is the device's named, even where another device is current
        out.value = 0
        other = 1 if gpu.device_count() > 1 else 0
        gpu.set_device(other)
        assert gpu.queue_kernel(call, 0, done, 0, 0)
        gpu.synchronize_stream(0)
        assert out.value == 7 and gpu.current_device() == 0
        # a captured stream: nothing queued, the caller captures it its own way
        side = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            assert not gpu.queue_kernel(call, side.cuda_stream, done, 0, 0)
        # a failed step is an error that names its driver call
        with pytest.raises(gpu.CudaError, match="cuLaunchKernel failed"):
            gpu.queue_kernel(gpu.KernelLaunch(0, 1, 1, _Put()), stream, done, 0, 0)
    finally:
        gpu.destroy_event(opened)
        gpu.destroy_event(done)
        gpu.destroy_stream(blocked)
        gpu.destroy_stream(stream)
        gpu.host_free(host)
