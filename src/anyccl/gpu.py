"""The few CUDA runtime calls anyccl needs: devices, streams, events, pointer attributes.

Through `cuda.bindings` (NVIDIA's official Python bindings, installed with ``anyccl[gpu]``),
imported on first use so that CPU-only installs never load CUDA. Every call's status is checked;
a failure raises `CudaError` naming the call.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from typing import Any, Callable

from .errors import AnycclError, InvalidArgumentError, UnsupportedError


class CudaError(AnycclError, RuntimeError):
    """A CUDA runtime call failed."""


@functools.cache
def _rt() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError:
        raise UnsupportedError(
            "GPU arrays need NVIDIA's cuda-bindings package: pip install 'anyccl[gpu]'") from None
    return runtime


def _check(result: Any, call: str) -> Any:
    """cuda.bindings returns (status, *values): raise on a bad status, return the values."""
    rt = _rt()
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    if status != rt.cudaError_t.cudaSuccess:
        _, text = rt.cudaGetErrorString(status)
        raise CudaError(f"{call} failed: {status.name}: {text.decode() if text else ''}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def device_count() -> int:
    """How many CUDA devices this process sees (0 when there is no driver or no bindings)."""
    try:
        rt = _rt()
    except UnsupportedError:
        return 0
    status, count = rt.cudaGetDeviceCount()
    return int(count) if status == rt.cudaError_t.cudaSuccess else 0


# handles that name a device's default stream rather than a stream of their own (legacy, legacy,
# per-thread): they mean the default stream of whichever device is current
NULL_STREAMS = frozenset((0, 1, 2))


def set_device(device: int) -> None:
    _check(_rt().cudaSetDevice(device), f"cudaSetDevice({device})")


def use_device(device: int) -> None:
    """Make `device` current if it is not (a query costs less than setting it)."""
    if current_device() != device:
        set_device(device)


def current_device() -> int:
    if _core is not None:
        ordinal = _core.device()  # the current context's device: what the runtime would say
        if ordinal >= 0:
            return ordinal
    return int(_check(_rt().cudaGetDevice(), "cudaGetDevice"))


_threads = threading.local()  # per thread: whether it is known to have a current CUDA context


def ensure_context(device: int) -> None:
    """Give the calling thread a current CUDA context if it has none (a thread that never used
    CUDA has none, and driver calls fail there): `device`'s primary context, as the runtime
    would make it. Looked up once per thread."""
    if getattr(_threads, "has_context", False):
        return
    if _core is not None:
        current = _core.context()
        if current < 0:
            _check_driver(_drv().CUresult(-current), "cuCtxGetCurrent")
    else:
        current = int(_driver_value(_drv().cuCtxGetCurrent(), "cuCtxGetCurrent"))
    if not current:
        set_device(device)
    _threads.has_context = True


def device_properties(device: int) -> Any:
    """cudaDeviceProp of `device` (name, totalGlobalMem, pciBusID, major, minor, ...)."""
    return _check(_rt().cudaGetDeviceProperties(device), "cudaGetDeviceProperties")


def device_name(device: int) -> str:
    name = device_properties(device).name
    return (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).rstrip("\0")


def pci_address(device: int, props: Any = None) -> str:
    """`device`'s PCI address as "0000:18:00" (domain:bus:device), from its properties."""
    p = props or device_properties(device)
    return f"{p.pciDomainID:04x}:{p.pciBusID:02x}:{p.pciDeviceID:02x}"


def device_of_pointer(ptr: int) -> int | None:
    """The device that owns `ptr`, or None for host memory."""
    rt = _rt()
    attrs = _check(rt.cudaPointerGetAttributes(ptr), "cudaPointerGetAttributes")
    if attrs.type in (rt.cudaMemoryType.cudaMemoryTypeDevice,
                      rt.cudaMemoryType.cudaMemoryTypeManaged):
        return int(attrs.device)
    return None


def can_access_peer(a: int, b: int) -> bool:
    return bool(_check(_rt().cudaDeviceCanAccessPeer(a, b), "cudaDeviceCanAccessPeer"))


def new_stream(device: int) -> int:
    """A non-blocking stream on `device` (it does not synchronise with the legacy stream)."""
    rt = _rt()
    set_device(device)
    stream = _check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking),
                    "cudaStreamCreateWithFlags")
    return int(stream)


def destroy_stream(stream: int) -> None:
    _check(_rt().cudaStreamDestroy(stream), "cudaStreamDestroy")


def new_event(device: int) -> int:
    rt = _rt()
    set_device(device)
    return int(_check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming),
                      "cudaEventCreateWithFlags"))


def destroy_event(event: int) -> None:
    _check(_rt().cudaEventDestroy(event), "cudaEventDestroy")


# The calls made on every GPU operation go through the driver API, compiled (_cudacore.c)
# where it was built and the driver library opens: the bindings' argument wrapping costs about a
# microsecond a call. Where it is not, cuda-bindings' driver API serves them: the one fallback.
def _load_core() -> Any:
    """anyccl's compiled driver calls (`_cudacore.c`), where the module was built and the driver
    library opens; else None (the bindings serve every call)."""
    try:
        from . import _cudacore
    except ImportError:
        return None
    return _cudacore if _cudacore.load() else None


_core = _load_core()


def calls_status() -> str:
    """How this process makes anyccl's per-operation CUDA calls, as `anyccl info` says it."""
    try:
        from . import _cudacore  # noqa: F401 - only whether it was built
    except ImportError:
        return "cuda-bindings' driver API (the compiled core was not built)"
    if _core is None:
        return "compiled core built; no CUDA driver library here"
    return "compiled core (built, driver loaded)"


@functools.cache
def _drv() -> Any:
    from cuda.bindings import driver

    return driver


def _check_driver(status: Any, call: str) -> None:
    driver = _drv()
    if status != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(status)
        raise CudaError(f"{call} failed: {status.name}: {text.decode() if text else ''}")


def record(event: int, stream: int) -> None:
    if _core is not None:
        status = _core.record(event, stream)
        if status:
            _check_driver(_drv().CUresult(status), "cuEventRecord")
    else:
        _check_driver(_drv().cuEventRecord(event, stream)[0], "cuEventRecord")


def stream_wait(stream: int, event: int) -> None:
    """Work queued on `stream` from now on waits for `event` (no host block)."""
    if _core is not None:
        status = _core.stream_wait(stream, event)
        if status:
            _check_driver(_drv().CUresult(status), "cuStreamWaitEvent")
    else:
        _check_driver(_drv().cuStreamWaitEvent(stream, event, 0)[0], "cuStreamWaitEvent")


def follow(stream: int, event: int, after: int) -> None:
    """Work queued on `stream` from now on waits for the work queued on stream `after` so far
    (through `event`, recorded on `after`; no host block): one compiled call where it is built."""
    if _core is None:
        record(event, after)
        stream_wait(stream, event)
        return
    status = _core.follow(stream, event, after)
    if status:
        failed, step = divmod(-status, 2)
        _check_driver(_drv().CUresult(failed), ("cuEventRecord", "cuStreamWaitEvent")[step])


_NOT_READY = 600  # CUDA_ERROR_NOT_READY


def event_done(event: int) -> bool:
    if _core is not None:
        status = _core.query(event)
        if status == _NOT_READY:
            return False
        if status:
            _check_driver(_drv().CUresult(status), "cuEventQuery")
        return True
    driver = _drv()
    status = driver.cuEventQuery(event)[0]
    if status == driver.CUresult.CUDA_ERROR_NOT_READY:
        return False
    _check_driver(status, "cuEventQuery")
    return True


def wait_event(event: int, deadline: float, check: Any = None,
               max_pause: float = 1e-3) -> bool:
    """Block the host until `event` completed (True) or the monotonic `deadline` passed (False),
    sleeping between queries from 2 us up to `max_pause`; `check()`, if given, runs before each
    sleep (to raise an error some other thread recorded)."""
    import time

    pause = 2e-6
    while not event_done(event):
        if check is not None:
            check()
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, max_pause)
    return True


def synchronize_stream(stream: int) -> None:
    _check(_rt().cudaStreamSynchronize(stream), "cudaStreamSynchronize")


def stream_pointer(stream: Any, name: str = "stream") -> int:
    """The CUDA stream handle of a PyTorch, CuPy, cuda.core or Numba stream, or of an int."""
    if isinstance(stream, bool):
        raise InvalidArgumentError(f"{name}={stream!r} is not a CUDA stream")
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):  # cuda.core protocol: (version, handle)
        return int(stream.__cuda_stream__()[1])
    for attribute in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attribute, None)
        if value is not None:
            try:
                return int(value)
            except (TypeError, ValueError):
                continue
    raise InvalidArgumentError(
        f"{name}={stream!r} is not a CUDA stream; pass a torch.cuda.Stream, a cupy Stream, a "
        f"cuda.core Stream or its integer handle")


def visible_devices() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "(all)")


def machine_has_gpu() -> bool:
    """Whether this machine has an NVIDIA GPU at all (its driver's device files), whatever
    Python packages are installed: what `anyccl info` advises depends on it."""
    import glob

    return os.path.isdir("/proc/driver/nvidia/gpus") or bool(glob.glob("/dev/nvidia[0-9]*"))


NO_GPU = "not usable: this machine has no NVIDIA GPU"


def imported(module: str) -> Any:
    """A framework module only if the user already imported it: anyccl never imports one."""
    return sys.modules.get(module)


def malloc_async(nbytes: int, stream: int) -> int:
    """Stream-ordered device memory (freed with `free_async` on the same stream)."""
    return int(_check(_rt().cudaMallocAsync(max(nbytes, 1), stream), "cudaMallocAsync"))


def free_async(ptr: int, stream: int) -> None:
    _check(_rt().cudaFreeAsync(ptr, stream), "cudaFreeAsync")


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queue a copy between device addresses, on this device or a peer's (mapped through CUDA
    IPC or peer access): the copy engines move it."""
    rt = _rt()
    _check(rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault, stream),
           "cudaMemcpyAsync")


def pinned_alloc(nbytes: int) -> int:
    """Page-locked host memory (the GPU's copy engines reach it directly); `pinned_free`s."""
    return int(_check(_rt().cudaMallocHost(max(nbytes, 1)), "cudaMallocHost"))


def pinned_free(ptr: int) -> None:
    _check(_rt().cudaFreeHost(ptr), "cudaFreeHost")


def memset32_async(ptr: int, value: int, words: int, stream: int) -> None:
    """Queue setting `words` 32-bit words at `ptr` to `value`."""
    _check_driver(_drv().cuMemsetD32Async(ptr, value, words, stream)[0], "cuMemsetD32Async")


def wait_value(stream: int, address: int, value: int) -> None:
    """Work queued on `stream` from now on waits until the 32-bit word at device `address`
    reaches `value` (a stream memory operation: compared as (int32)(word - value) >= 0)."""
    _check_driver(_drv().cuStreamWaitValue32(stream, address, value, 0)[0],
                  "cuStreamWaitValue32")


# ---- what the ipc backend needs: modules, raw device memory, IPC handles, mapped host memory --
def _driver_value(result: Any, call: str) -> Any:
    _check_driver(result[0], call)
    return result[1] if len(result) == 2 else result[1:]


def compute_capability(device: int) -> tuple[int, int]:
    props = device_properties(device)
    return int(props.major), int(props.minor)


def load_module(image: bytes) -> Any:
    """Load a cubin into the current context (cuModuleLoadData)."""
    return _driver_value(_drv().cuModuleLoadData(image), "cuModuleLoadData")


def module_function(module: Any, name: str) -> Any:
    return _driver_value(_drv().cuModuleGetFunction(module, name.encode()),
                         f"cuModuleGetFunction({name})")


@functools.cache
def _libcuda_launch() -> Any:
    """cuLaunchKernel straight from the driver library through ctypes: a launch costs ~1 us
    of host time this way, several times less than through the bindings' argument checks."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    u, p = ctypes.c_uint, ctypes.c_void_p
    fn.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
    fn.restype = ctypes.c_int
    return fn


def launch(function: Any, blocks: int, threads: int, stream: int, params: int) -> None:
    """Queue `function` (a CUfunction or its address) on `stream`; `params` is the address of
    its void* argument array."""
    if _core is not None:
        status = _core.launch(int(function), blocks, threads, stream, params)
        if status:
            _check_driver(_drv().CUresult(status), "cuLaunchKernel")
        return
    status = _libcuda_launch()(int(function), blocks, 1, 1, threads, 1, 1, 0, stream or None,
                               params, None)
    if status:
        _check_driver(_drv().CUresult(status), "cuLaunchKernel")


class KernelLaunch:
    """One launch of a kernel whose argument block is its own: `args`, a ctypes structure the
    kernel takes by value as its only parameter. Queuing it again writes nothing, so a cached
    plan replays it in one driver call (`queue_kernel`); calling it launches it on `stream`."""

    __slots__ = ("function", "blocks", "threads", "args", "_params", "params", "packed")

    def __init__(self, function: Any, blocks: int, threads: int, args: ctypes.Structure) -> None:
        self.function, self.blocks, self.threads, self.args = int(function), blocks, threads, args
        self._params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        self.params = ctypes.addressof(self._params)
        # what the compiled replay takes (_cudacore.c): 0, then queue_kernel's arguments
        self.packed = (0, self.function, blocks, threads, self.params)

    def __call__(self, stream: int) -> None:
        launch(self.function, self.blocks, self.threads, stream, self.params)


class NcclCall:
    """One NCCL collective whose arguments are fixed (a cached plan's): `function`, NCCL's entry
    point (ncclAllReduce and its like), its arguments (send, recv, count, datatype, the op or
    root or None, the communicator's handle), `fallback`, the same call through nccl4py's
    bindings, which calling it runs (async operations, CUDA graph capture, no compiled core),
    and `check`, which raises NCCL's error for a failed ncclResult_t. A replay queues it in one
    compiled call (`queue_nccl`)."""

    __slots__ = ("function", "args", "fallback", "check", "packed")

    def __init__(self, function: int, args: tuple[int, int, int, int, int | None, int],
                 fallback: Callable[[int], None], check: Callable[[int], None]) -> None:
        send, recv, count, dtype, op, comm = args
        self.function, self.fallback, self.check = function, fallback, check
        self.args = (int(op is not None), send, recv, count, dtype, op or 0, comm)
        # what the compiled replay takes (_cudacore.c): 1, then queue_nccl's arguments
        self.packed = (1, function, *self.args)

    def __call__(self, stream: int) -> None:
        self.fallback(stream)


_REPLAY_STEPS = ("cuStreamIsCapturing", "cuStreamWaitEvent", "cuLaunchKernel",
                 "cuEventRecord")


def queue_kernel(call: KernelLaunch, stream: int, event: int, after: int, device: int) -> bool:
    """Queue `call` on `stream` after event `after` (0: no wait) and record `event` after it;
    False, with nothing queued, if `stream` is being captured into a CUDA graph. A thread with
    no current context gets `device`'s first (`ensure_context`), and a null stream is taken
    as `device`'s (made current if it is not). One compiled call where the CUDA core loaded."""
    if _core is None:
        return queue_in_steps(call, stream, event, after, device)
    status = _core.queue_kernel(stream, call.function, call.blocks, call.threads, call.params,
                                event, after, device)
    return not status or _replayed(status, call, stream, event, after, device)


def queue_nccl(call: NcclCall, stream: int, event: int, after: int, device: int) -> bool:
    """`queue_kernel` for one NCCL collective: the stream's wait, NCCL's call and the event's
    record in one compiled call where the CUDA core loaded; NCCL's own error if it fails."""
    if _core is None:
        return queue_in_steps(call, stream, event, after, device)
    status = _core.queue_nccl(stream, call.function, *call.args, event, after, device)
    if status < 0 and -status % 4 == 2:
        call.check(-status // 4)   # NCCL's error
        raise CudaError(f"NCCL returned ncclResult_t {-status // 4} on stream {stream:#x}")
    return not status or _replayed(status, call, stream, event, after, device)


def _replayed(status: int, call: Callable[[int], None], stream: int, event: int, after: int,
              device: int) -> bool:
    """What a compiled replay's `status` means (see _cudacore.c): True once queued, False where
    the stream is being captured; CudaError naming the driver call that failed."""
    if status <= 0:
        if status:
            code, step = divmod(-status, 4)
            _check_driver(_drv().CUresult(code), _REPLAY_STEPS[step])
        return True
    if status == 2:   # a thread new to CUDA, or a null stream of another device: the long way
        return queue_in_steps(call, stream, event, after, device)
    return False


# what queues each kind of replayed operation in one compiled call
ONE_CALL: dict[type, Callable[..., bool]] = {KernelLaunch: queue_kernel, NcclCall: queue_nccl}


def queue_in_steps(call: Callable[[int], None], stream: int, event: int, after: int,
                   device: int) -> bool:
    """`queue_kernel` as one driver call after another (where the CUDA core is not built)."""
    ensure_context(device)
    if stream in NULL_STREAMS:
        use_device(device)  # a null stream is the current device's
    if is_capturing(stream):
        return False
    if after:
        stream_wait(stream, after)
    call(stream)
    record(event, stream)
    return True


def relax_capture_mode() -> None:
    """Let this thread query events while another thread captures a CUDA graph (in the default,
    global mode, such a query from any thread would invalidate the capture)."""
    rt = _rt()
    relaxed = rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
    _check(rt.cudaThreadExchangeStreamCaptureMode(relaxed), "cudaThreadExchangeStreamCaptureMode")


def is_capturing(stream: int) -> bool:
    """Whether `stream` is being captured into a CUDA graph."""
    if _core is not None:
        status = _core.capturing(stream)
        if status < 0:
            _check_driver(_drv().CUresult(-status), "cuStreamIsCapturing")
        return status != 0
    driver = _drv()
    status = _driver_value(driver.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
    return status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def mem_alloc(nbytes: int) -> int:
    """Plain device memory in the current context (cuMemAlloc): what CUDA IPC can export."""
    return int(_driver_value(_drv().cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})"))


def mem_free(ptr: int) -> None:
    _check_driver(_drv().cuMemFree(ptr)[0], "cuMemFree")


def memset(ptr: int, value: int, nbytes: int) -> None:
    """Set bytes and wait for it (cuMemsetD8 + cuCtxSynchronize)."""
    driver = _drv()
    _check_driver(driver.cuMemsetD8(ptr, value, nbytes)[0], "cuMemsetD8")
    _check_driver(driver.cuCtxSynchronize()[0], "cuCtxSynchronize")


IPC_HANDLE_BYTES = 64


def ipc_handle(ptr: int) -> bytes:
    """The 64-byte CUDA IPC handle of an allocation made by `mem_alloc`."""
    import ctypes

    handle = _driver_value(_drv().cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def ipc_open(handle: bytes) -> int:
    """Map another process's allocation into this one (peer access enabled as needed)."""
    import ctypes

    driver = _drv()
    h = driver.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_BYTES)
    flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    return int(_driver_value(driver.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))


def ipc_close(ptr: int) -> None:
    _check_driver(_drv().cuIpcCloseMemHandle(ptr)[0], "cuIpcCloseMemHandle")


def host_alloc_mapped(nbytes: int) -> tuple[int, int]:
    """Pinned host memory the GPU reads and writes directly: (host address, device address)."""
    driver = _drv()
    flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
    host = int(_driver_value(driver.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc"))
    device = int(_driver_value(driver.cuMemHostGetDevicePointer(host, 0),
                               "cuMemHostGetDevicePointer"))
    return host, device


def host_free(ptr: int) -> None:
    _check_driver(_drv().cuMemFreeHost(ptr)[0], "cuMemFreeHost")
