"""Host time of the CUDA driver calls an eager anyccl GPU operation makes (record an event, make
a stream wait, query an event, ask whether a stream is captured, read the current device),
through cuda.bindings' driver module (what anyccl.gpu uses) beside the same calls made straight
into libcuda through ctypes, each wrapped with its status check as anyccl would. One GPU.

Measured on an H200 (2026-11-23): the bindings cost 0.15-0.6 us per call, ctypes 0.6-0.8
(equal for the event query): ctypes is no faster for these, so anyccl keeps the bindings
for them (kernel launches do go through ctypes: the bindings' launch packs its arguments).

    python3 benchmarks/lab/cuda_call_cost.py [--calls 100000]
"""

import argparse
import ctypes
import time

from cuda.bindings import driver

from anyccl import gpu

parser = argparse.ArgumentParser()
parser.add_argument("--calls", type=int, default=100000)
args = parser.parse_args()

gpu.set_device(0)
stream, event = gpu.new_stream(0), gpu.new_event(0)
gpu.record(event, stream)
gpu.synchronize_stream(stream)

lib = ctypes.CDLL("libcuda.so.1")
p, out = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
for name, argtypes in {"cuEventRecord": [p, p], "cuStreamWaitEvent": [p, p, ctypes.c_uint],
                       "cuEventQuery": [p], "cuStreamIsCapturing": [p, out],
                       "cuCtxGetDevice": [out]}.items():
    getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, ctypes.c_int


def checked(status: int) -> None:
    if status not in (0, 600):  # success, not ready
        raise RuntimeError(f"CUresult {status}")


def ctypes_capturing() -> bool:
    found = ctypes.c_int()
    checked(lib.cuStreamIsCapturing(stream, ctypes.byref(found)))
    return found.value != 0


def ctypes_device() -> int:
    found = ctypes.c_int()
    checked(lib.cuCtxGetDevice(ctypes.byref(found)))
    return found.value


def cost(call) -> float:
    """Microseconds per call (median of five timed loops)."""
    for _ in range(1000):
        call()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(args.calls // 5):
            call()
        times.append((time.perf_counter() - t0) / (args.calls // 5))
    gpu.synchronize_stream(stream)
    return sorted(times)[2] * 1e6


rows = [
    ("record an event", lambda: gpu.record(event, stream),
     lambda: checked(lib.cuEventRecord(event, stream))),
    ("stream waits for an event", lambda: gpu.stream_wait(stream, event),
     lambda: checked(lib.cuStreamWaitEvent(stream, event, 0))),
    ("query an event", lambda: gpu.event_done(event), lambda: checked(lib.cuEventQuery(event))),
    ("is the stream captured", lambda: gpu.is_capturing(stream), ctypes_capturing),
    ("the current device", lambda: driver.cuCtxGetDevice(), ctypes_device),
]
print(f"{'driver call':<28} {'cuda.bindings':>14} {'ctypes':>8}   (us per call)")
for name, bindings, direct in rows:
    print(f"{name:<28} {cost(bindings):14.2f} {cost(direct):8.2f}", flush=True)
