"""Users' arrays seen without copying: host arrays as NumPy views, GPU arrays as `GpuArray`.

Host: NumPy arrays, PyTorch CPU tensors (bfloat16 included), and any object NumPy can view
through the buffer protocol or ``__array_interface__``. GPU: PyTorch CUDA tensors, CuPy arrays,
JAX arrays on a GPU, objects with ``__cuda_array_interface__`` and CUDA DLPack capsules'
producers. The adapters check what a collective must know before a byte moves (contiguity,
writability, dtype, device) and name the argument when they refuse.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, Callable, Union

import ml_dtypes
import numpy as np

from .errors import InvalidArgumentError, UnsupportedError

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(d) for d in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, BFLOAT16, np.float32, np.float64, np.complex64, np.complex128,
))
SUPPORTED = frozenset(SUPPORTED_DTYPES)  # the dtypes every backend moves


def _torch_module() -> Any:
    # Only look at torch if the user already imported it: anyccl never imports torch itself.
    return sys.modules.get("torch")


def _check_torch_layout(t: Any, name: str) -> None:
    torch = _torch_module()
    if t.layout != torch.strided:
        raise UnsupportedError(f"{name} has layout {t.layout}; only dense (strided) tensors")
    if t.is_conj() or t.is_neg():
        raise InvalidArgumentError(
            f"{name} is a lazy conjugate/negative view; call .resolve_conj()/.resolve_neg() first")


class _TorchMemory:
    """A CPU tensor's memory as NumPy sees it (`__array_interface__` over its data pointer),
    keeping the tensor alive. Not `Tensor.numpy()`: that marks the tensor's storage
    non-resizable for good, which breaks FSDP's storage freeing (pytorch#119233)."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: Any, typestr: str) -> None:
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                    "typestr": typestr, "version": 3}
        if not t.is_contiguous():   # strides in bytes (a tensor's are in elements)
            size = t.element_size()
            self.__array_interface__["strides"] = tuple(s * size for s in t.stride())


def _torch_to_numpy(t: Any, name: str) -> np.ndarray:
    _check_torch_layout(t, name)
    dtype = _torch_dtype(t, name)
    if t.numel() == 0:
        return np.empty(tuple(t.shape), dtype)
    if dtype == BFLOAT16:
        return np.asarray(_TorchMemory(t, "<u2")).view(BFLOAT16)
    return np.asarray(_TorchMemory(t, dtype.str))


_KDL_CPU = 1  # DLPack's device type of host memory


def _from_host_dlpack(x: Any, name: str) -> np.ndarray:
    """A NumPy view of a host array known only through DLPack (`__dlpack__`); torch imports
    what NumPy cannot (bfloat16), when torch is there."""
    device_type = int(x.__dlpack_device__()[0])
    if device_type != _KDL_CPU:
        raise UnsupportedError(f"{name} is a DLPack array on device type {device_type}; "
                               f"expected host memory or a CUDA GPU")
    try:
        return np.from_dlpack(x)
    except (BufferError, RuntimeError) as exc:   # a dtype NumPy lacks (bfloat16)
        torch = _torch_module()
        if torch is None:
            raise UnsupportedError(f"{name} is a DLPack array NumPy cannot read ({exc}); "
                                   f"import torch, or pass a NumPy array") from None
        return _torch_to_numpy(torch.from_dlpack(x), name)


def as_numpy(x: Any, name: str, *, writable: bool) -> np.ndarray:
    """Return a NumPy array sharing memory with `x`, with `x`'s strides (contiguous or not:
    layouts.py copies what is not).

    Raises InvalidArgumentError for read-only arrays when `writable`, UnsupportedError for
    unsupported types and dtypes. Never copies: what a collective writes into the returned array
    lands in `x`.
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif type(x).__module__.startswith("torch") and _torch_module() is not None \
            and isinstance(x, _torch_module().Tensor):
        if x.device.type != "cpu":
            raise UnsupportedError(f"{name} is a torch tensor on {x.device}; expected a host array")
        arr = _torch_to_numpy(x, name)
    elif x is None:
        raise InvalidArgumentError(f"{name} is None; expected an array")
    elif isinstance(x, (int, float, complex, bool, list, tuple)):
        raise InvalidArgumentError(
            f"{name} is a Python {type(x).__name__}; expected an array (a collective writes its "
            f"result in place, so wrap values in a NumPy array or a tensor)")
    else:
        if hasattr(x, "__cuda_array_interface__"):
            raise UnsupportedError(
                f"{name} is a GPU array ({type(x).__name__}); this communicator's backend serves "
                f"CPU arrays only")
        if hasattr(x, "__dlpack__") and not hasattr(x, "__array__") \
                and not hasattr(x, "__array_interface__"):
            arr = _from_host_dlpack(x, name)   # an array that speaks DLPack alone
        else:
            try:
                arr = np.asarray(x)
            except Exception as exc:  # numpy raises many types for objects it cannot view
                raise UnsupportedError(f"{name} of type {type(x).__name__} is not an "
                                       f"array") from exc
            if arr.dtype == object:
                raise UnsupportedError(f"{name} of type {type(x).__name__} is not an array")
            if writable and arr.base is None:  # NumPy built a new array: writes would be lost
                raise InvalidArgumentError(
                    f"{name} of type {type(x).__name__} cannot be written in place; pass a "
                    f"NumPy array or a tensor")
    if arr.dtype not in SUPPORTED:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise UnsupportedError(f"{name} has dtype {arr.dtype}; supported: {names}")
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError(f"{name} is read-only but receives the result; pass a writable "
                                   f"array")
    return arr


def immutable_copy(x: Any) -> tuple[np.ndarray, Callable[[np.ndarray], Any]] | None:
    """For an input an in-place collective cannot write (a JAX array on the host, a read-only
    NumPy array): a writable NumPy copy of it and the function that makes the result an array
    of `x`'s kind again (a JAX array with `x`'s sharding, a NumPy array). None for everything
    else: arrays written in place, and what `as_array` refuses as before."""
    if isinstance(x, np.ndarray):
        return None if x.flags.writeable else (x.copy(), _same)
    if type(x).__module__.startswith(("jax", "jaxlib")) and hasattr(x, "sharding") and \
            all(d.platform == "cpu" for d in x.devices()):
        import jax

        sharding = x.sharding
        return np.array(x), lambda result: jax.device_put(result, sharding)
    return None


def _same(result: np.ndarray) -> np.ndarray:
    return result


# ---- GPU arrays ---------------------------------------------------------------------------------
_KDL_CUDA = 2  # DLPack's device type of CUDA memory


class GpuArray:
    """A contiguous run of `size` elements of `dtype` at device pointer `ptr` on `device`.

    `stream` is the stream the array's producer works on now (its framework's current stream), or
    None when the framework has no stream to order after (JAX): then anyccl synchronises on the
    host before and after the operation. `owner` is the user's array (None in a `bare` copy):
    the GPU engine's queued operation holds its arrays, so their owners, until it is done; a
    cached plan's function is built from bare copies, so that it keeps no user's array alive.
    A value: never changed after it is made (a plain slotted class, not a frozen dataclass,
    because every GPU call makes several and a frozen dataclass takes five times as long).
    """

    __slots__ = ("ptr", "size", "dtype", "device", "stream", "kind", "owner")

    def __init__(self, ptr: int, size: int, dtype: np.dtype, device: int, stream: int | None,
                 kind: str, owner: Any) -> None:
        self.ptr, self.size, self.dtype, self.device = ptr, size, dtype, device
        self.stream, self.kind, self.owner = stream, kind, owner

    def __repr__(self) -> str:
        return (f"GpuArray(ptr={self.ptr:#x}, size={self.size}, dtype={self.dtype}, "
                f"device={self.device}, stream={self.stream}, kind={self.kind!r})")

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def reshape(self, *_: Any) -> GpuArray:
        return self  # always flat

    def __getitem__(self, s: slice) -> GpuArray:
        start, stop, step = s.indices(self.size)
        if step != 1:
            raise InvalidArgumentError("GpuArray pieces must be contiguous")
        stop = max(stop, start)
        return GpuArray(self.ptr + start * self.dtype.itemsize, stop - start, self.dtype,
                        self.device, self.stream, self.kind, self.owner)

    def bare(self) -> GpuArray:
        """This array without its owner."""
        return GpuArray(self.ptr, self.size, self.dtype, self.device, self.stream, self.kind, None)

    def pieces(self, count: int, size: int) -> list[GpuArray]:
        """The first `size` consecutive pieces of `count` elements (made directly: collectives
        split an array into pieces on every call)."""
        step = count * self.dtype.itemsize
        return [GpuArray(self.ptr + i * step, count, self.dtype, self.device, self.stream,
                         self.kind, self.owner) for i in range(size)]

    def synchronize_producer(self) -> None:
        """For arrays without a stream: wait on the host until their producer wrote them."""
        if self.stream is None and hasattr(self.owner, "block_until_ready"):
            self.owner.block_until_ready()


Array = Union[np.ndarray, GpuArray]


def _dtype_or_refuse(dtype: Any, name: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt not in SUPPORTED:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise UnsupportedError(f"{name} has dtype {dtype}; supported: {names}")
    return dt


_TORCH_DTYPES: dict[Any, np.dtype] = {}  # torch dtype -> NumPy dtype, filled on first use


def _torch_dtype(t: Any, name: str) -> np.dtype:
    found = _TORCH_DTYPES.get(t.dtype)
    if found is not None:
        return found
    torch = _torch_module()
    if t.dtype == torch.bfloat16:
        found = BFLOAT16
    else:
        try:
            found = _dtype_or_refuse(torch.empty(0, dtype=t.dtype).numpy().dtype, name)
        except TypeError:
            raise UnsupportedError(f"{name} has dtype {t.dtype}, which anyccl does not "
                                   f"support") from None
    _TORCH_DTYPES[t.dtype] = found
    return found


def torch_stream(device: int) -> int:
    """The handle of torch's current CUDA stream on `device` (0: the legacy default stream)."""
    return torch_stream_function()(device)


@functools.cache
def torch_stream_function() -> Callable[[int], int]:
    """`torch_stream` itself, at its cheapest: torch's own lookup where it has one (looked up
    once; only called where torch is imported)."""
    torch = _torch_module()
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw_stream is None:
        return lambda device: torch.cuda.current_stream(device).cuda_stream
    return raw_stream


class NotContiguousGpuArray(InvalidArgumentError):
    """A torch CUDA tensor or CuPy array that is not C-contiguous (`array`, also when it came
    through DLPack): the argument checks run the operation on a contiguous copy (layouts.py)
    instead of refusing it."""

    def __init__(self, message: str, array: Any = None) -> None:
        super().__init__(message)
        self.array = array


def _from_torch(t: Any, name: str) -> GpuArray:
    _check_torch_layout(t, name)
    if not t.is_contiguous():
        raise NotContiguousGpuArray(
            f"{name} is a GPU tensor that is not contiguous (shape {tuple(t.shape)}, strides "
            f"{t.stride()})", t)
    device = t.get_device()  # an int, without building a torch.device
    return GpuArray(t.data_ptr(), t.numel(), _torch_dtype(t, name), device, torch_stream(device),
                    "torch", t)


def cuda_tensor_key(x: Any) -> tuple[int, int, Any] | None:
    """(data pointer, elements, torch dtype) of a dense, contiguous torch tensor: what
    identifies a GPU array to a cached plan (`plans.py`), in the fewest tensor reads (a host
    tensor's pointer never equals a device pointer: CUDA keeps one address space for both,
    and plans refuse complex dtypes, whose conjugate views share the pointer); None for any
    other array, which then takes the full checks."""
    torch = _torch_module()
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    try:
        if x.is_neg() or not x.is_contiguous():
            return None
        return x.data_ptr(), x.numel(), x.dtype
    except RuntimeError:  # sparse and other layouts without a data pointer
        return None


def _from_cupy(x: Any, name: str) -> GpuArray:
    import cupy

    if not x.flags.c_contiguous:
        raise NotContiguousGpuArray(
            f"{name} is not C-contiguous (shape {x.shape}, strides {x.strides})", x)
    device = int(x.device.id)
    with cupy.cuda.Device(device):
        stream = cupy.cuda.get_current_stream().ptr
    return GpuArray(int(x.data.ptr), int(x.size), _dtype_or_refuse(x.dtype, name), device,
                    stream, "cupy", x)


def _from_jax(x: Any, name: str) -> GpuArray:
    devices = list(x.devices())
    if len(devices) != 1:
        raise UnsupportedError(f"{name} is a JAX array sharded over {len(devices)} devices; pass "
                               f"one addressable shard (x.addressable_shards[i].data)")
    device = devices[0]
    if device.platform not in ("gpu", "cuda"):
        raise UnsupportedError(f"{name} is a JAX array on {device.platform}; expected a GPU "
                               f"array or a host array")
    if x.size and not getattr(x, "is_fully_replicated", True):
        raise UnsupportedError(f"{name} is a sharded JAX array")
    x.block_until_ready()
    return GpuArray(int(x.unsafe_buffer_pointer()), int(x.size), _dtype_or_refuse(x.dtype, name),
                    int(device.local_hardware_id), None, "jax", x)


def _from_cuda_array_interface(x: Any, name: str) -> GpuArray:
    from . import gpu

    cai = x.__cuda_array_interface__
    dtype = _dtype_or_refuse(np.dtype(cai["typestr"]), name)
    shape = tuple(int(d) for d in cai["shape"])
    size = math.prod(shape)
    strides = cai.get("strides")
    if strides is not None and size > 1:
        expected = tuple(math.prod(shape[i + 1:]) * dtype.itemsize
                         for i in range(len(shape)))
        if any(st != ex for st, ex, n in zip(strides, expected, shape) if n > 1):
            raise InvalidArgumentError(f"{name} is not C-contiguous (shape {shape}, strides "
                                       f"{strides})")
    ptr, readonly = cai["data"]
    if readonly:
        raise InvalidArgumentError(f"{name} is a read-only GPU array")
    device = gpu.device_of_pointer(ptr) if ptr else gpu.current_device()
    if device is None:
        raise UnsupportedError(f"{name}'s __cuda_array_interface__ points at host memory")
    stream = cai.get("stream")
    return GpuArray(int(ptr), size, dtype, device, 0 if stream in (None, 1) else int(stream),
                    "cuda array interface", x)


def gpu_array(x: Any, name: str) -> GpuArray | None:
    """`x` as a GpuArray if it lives on a GPU; None for anything else. Never copies."""
    module = type(x).__module__
    torch = _torch_module()
    if torch is not None and module.startswith("torch") and isinstance(x, torch.Tensor):
        return _from_torch(x, name) if x.is_cuda else None
    if module.startswith("cupy"):
        return _from_cupy(x, name)
    if module.startswith("jax") or module.startswith("jaxlib"):
        return _from_jax(x, name) if hasattr(x, "unsafe_buffer_pointer") and any(
            d.platform != "cpu" for d in x.devices()) else None
    if isinstance(x, np.ndarray):
        return None
    if hasattr(x, "__cuda_array_interface__"):
        return _from_cuda_array_interface(x, name)
    if hasattr(x, "__dlpack_device__"):
        device_type, _ = x.__dlpack_device__()
        if int(device_type) != _KDL_CUDA:
            return None
        for module_name in ("torch", "cupy"):
            framework = sys.modules.get(module_name)
            if framework is not None:
                return gpu_array(framework.from_dlpack(x), name)
        raise UnsupportedError(f"{name} is a CUDA DLPack array; import torch or cupy so anyccl "
                               f"can read it")
    return None


def lives_on_gpu(x: Any) -> bool:
    """Whether `x`, or an entry of a list or tuple of them, is a GPU array (the kinds
    `gpu_array` reads); never raises: it serves error paths. An array `gpu_array` refuses to
    read counts as a GPU array (only those are refused there)."""
    if isinstance(x, (list, tuple)):
        return any(map(lives_on_gpu, x))
    try:
        return gpu_array(x, "array") is not None
    except Exception:  # noqa: BLE001 - a GPU array anyccl cannot read
        return True


def as_array(x: Any, name: str, *, writable: bool) -> Array:
    """A GpuArray for GPU arrays, else a NumPy view (see `as_numpy`). Never copies."""
    if type(x) is np.ndarray:  # the common host case: nothing to probe
        return as_numpy(x, name, writable=writable)
    found = gpu_array(x, name)
    return found if found is not None else as_numpy(x, name, writable=writable)


def overlaps(a: Array, b: Array) -> bool:
    """Whether two arrays share any byte."""
    if isinstance(a, GpuArray) and isinstance(b, GpuArray):
        return (a.device == b.device and a.nbytes > 0 and b.nbytes > 0
                and a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a is not b and a.base is None and b.base is None:
            return False  # two arrays that each own their memory: apart (the common case)
        return bool(a.size and b.size and np.may_share_memory(a, b))
    return False


def current_stream(a: GpuArray) -> Any:
    """A function returning the stream `a`'s framework works on at the time it is called (what
    a later ``Work.wait()`` must order); it returns None for JAX (wait on the host)."""
    device = a.device
    if a.kind == "torch":
        raw_stream = torch_stream_function()   # (torch.cuda.current_stream costs 6-7 us)
        return lambda: raw_stream(device)
    if a.kind == "cupy":
        import cupy

        def cupy_stream() -> int:
            with cupy.cuda.Device(device):
                return cupy.cuda.get_current_stream().ptr
        return cupy_stream
    stream = a.stream
    return lambda: stream


class Pieces(list):
    """The `size` consecutive pieces of `count` elements of one flat array `whole` (host or
    GPU), alike by construction: what a collective gets for an argument given as one array to
    split. Backends may treat the pieces as the one array they are."""

    def __init__(self, whole: Array, count: int, size: int) -> None:
        super().__init__(whole.pieces(count, size) if isinstance(whole, GpuArray) else
                         [whole[i * count:(i + 1) * count] for i in range(size)])
        self.whole = whole
