"""The compiled CUDA driver calls (`anyccl/_cudacore.c`): built by `pip install -e .` on any
machine (it opens the driver library at run time), refusing calls until it has loaded, and, on a
GPU, answering every call as NVIDIA's bindings do (gpu.py uses it in their place)."""

from __future__ import annotations

import ctypes

import pytest

from anyccl import gpu

_cudacore = pytest.importorskip("anyccl._cudacore", reason="the CUDA core was not built here")


def test_the_module_builds_everywhere_and_gpu_uses_it_only_where_the_driver_opens():
    loaded = _cudacore.load()
    assert loaded == (gpu._core is not None) or not gpu._DRIVER
    if not loaded:  # no driver library: every GPU call stays on the bindings
        with pytest.raises(RuntimeError, match="load"):
            _cudacore.record(1, 2)


def test_wrong_argument_counts_are_refused_by_name():
    with pytest.raises(TypeError, match=r"launch\(\) takes 5 arguments \(2 given\)"):
        _cudacore.launch(1, 2)
    with pytest.raises(TypeError, match=r"record\(\) takes 2 arguments \(1 given\)"):
        _cudacore.record(1)


@pytest.mark.gpu
def test_on_a_gpu_each_call_answers_as_the_bindings_do():
    torch = pytest.importorskip("torch")
    assert _cudacore.load() and gpu._core is _cudacore
    torch.cuda.set_device(0)
    torch.cuda.init()
    driver = gpu._drv()
    stream, event, done = gpu.new_stream(0), gpu.new_event(0), gpu.new_event(0)
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
            assert not gpu.event_done(done)
            word.value = 1
            gpu.synchronize_stream(other)
            assert gpu.event_done(event) and gpu.event_done(done)
            gpu.destroy_stream(other)
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
    finally:
        gpu.destroy_event(event)
        gpu.destroy_event(done)
        gpu.destroy_stream(stream)
