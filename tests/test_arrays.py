"""Arrays of any shape and both kinds (NumPy, torch CPU) are used in place, without copies."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from harness import run_ranks

import anyccl


def check_shapes(comm):
    for shape in [(), (3, 4), (2, 0, 5), (1, 1, 1, 7)]:
        x = np.full(shape, comm.rank + 1, np.int32)
        address = x.ctypes.data
        comm.all_reduce(x)
        assert x.shape == shape and x.ctypes.data == address
        assert (x == comm.size * (comm.size + 1) // 2).all()
        out = np.empty((comm.size, *shape), np.int32)
        comm.all_gather(out, np.full(shape, comm.rank, np.int32))
        assert all((out[r] == r).all() for r in range(comm.size))
    return True


def test_any_shape_including_scalars_and_empty_arrays():
    assert all(run_ranks(check_shapes, 3))


def check_torch_dtypes_in_place(comm):
    import torch

    dtypes = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
    for dtype in dtypes:
        t = torch.ones((2, 3), dtype=dtype) * (comm.rank + 1) if dtype != torch.bool \
            else torch.tensor([[comm.rank == 0] * 3] * 2)
        t.requires_grad_(dtype.is_floating_point)
        pointer = t.data_ptr()
        op = anyccl.ReduceOp.MAX if dtype != torch.complex64 else anyccl.ReduceOp.SUM
        comm.all_reduce(t, op=op)
        assert t.data_ptr() == pointer, dtype
        expected = {torch.bool: True, torch.complex64: comm.size * (comm.size + 1) / 2}.get(
            dtype, comm.size)
        assert (t.detach() == expected).all(), (dtype, t)
    return True


def test_torch_tensors_of_every_dtype_reduce_in_place():
    pytest.importorskip("torch")
    assert all(run_ranks(check_torch_dtypes_in_place, 2))


def test_an_expanded_torch_tensor_cannot_receive_a_result():
    """Its elements share memory (stride 0); a transposed tensor is fine (test_layouts.py)."""
    torch = pytest.importorskip("torch")
    comm = anyccl.init()
    with pytest.raises(anyccl.InvalidArgumentError,
                       match=r"tensor \(a torch tensor\) has elements that share memory "
                             r"\(shape \(4, 4\), strides \(0, 4\)\)"):
        comm.all_reduce(torch.ones(4).expand(4, 4))
    t = torch.ones(4, 4).t()
    assert comm.all_reduce(t) is t and (t == 1).all()
    comm.close()


def test_segments_are_private_to_the_user():
    from anyccl.backends.shm import _Segment

    seg = _Segment(f"/anyccl-test-{os.getpid()}", 4096, create=True)
    try:
        mode = stat.S_IMODE(os.stat(f"/dev/shm{seg.name}").st_mode)
        assert mode == 0o600, oct(mode)
    finally:
        seg.close()
        seg.unlink()
    assert not os.path.exists(f"/dev/shm{seg.name}")


def test_a_gpu_array_splits_into_consecutive_pieces_like_its_slices():
    from anyccl.buffers import GpuArray

    owner = object()
    whole = GpuArray(1 << 32, 12, np.dtype(np.float16), 3, 77, "torch", owner)
    pieces = whole.pieces(4, 3)
    for i, piece in enumerate(pieces):
        want = whole[i * 4:(i + 1) * 4]
        assert (piece.ptr, piece.size, piece.dtype, piece.device, piece.stream, piece.kind) == \
            (want.ptr, want.size, want.dtype, want.device, want.stream, want.kind)
        assert piece.owner is owner                       # the user's array, for the queue
    assert pieces[1].ptr == whole.ptr + 8                 # 4 float16 elements further
    bare = whole.bare()                                   # what a GPU backend gets
    assert bare.owner is None and (bare.ptr, bare.size, bare.stream) == (whole.ptr, 12, 77)


def check_results_are_returned_for_every_kind(comm):
    """`y = comm.all_reduce(x)` works for every array: a writable one is written in place and
    returned; one that cannot be written (a read-only NumPy array, a JAX array) is left as it
    was, and a new array of its kind holds the result. The same for broadcast and reduce."""
    import torch

    n, total = comm.size, comm.size * (comm.size + 1) // 2
    x = np.full(5, comm.rank + 1.0)
    assert comm.all_reduce(x) is x and (x == total).all()
    t = torch.full((2, 3), comm.rank + 1.0)
    assert comm.all_reduce(t) is t and bool((t == total).all())
    frozen = np.full(5, comm.rank + 1.0)
    frozen.flags.writeable = False
    y = comm.all_reduce(frozen, "max")
    assert type(y) is np.ndarray and y.flags.writeable and (y == n).all()
    assert (frozen == comm.rank + 1).all()
    b = comm.broadcast(frozen, src=n - 1)
    assert (b == n).all() and (frozen == comm.rank + 1).all()
    r = comm.reduce(frozen, dst=0)
    assert (r == (total if comm.rank == 0 else comm.rank + 1)).all()
    return True


def test_every_in_place_collective_returns_the_array_holding_its_result():
    pytest.importorskip("torch")
    assert all(run_ranks(check_results_are_returned_for_every_kind, 3))


def check_jax_arrays(comm):
    import jax
    import jax.numpy as jnp

    x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3) + comm.rank
    y = comm.all_reduce(x)
    assert isinstance(y, jax.Array) and y.shape == (2, 3) and y.dtype == jnp.float32
    expected = sum(np.arange(6, dtype=np.float32).reshape(2, 3) + r for r in range(comm.size))
    assert np.array_equal(np.asarray(y), expected)
    assert np.array_equal(np.asarray(x), np.arange(6).reshape(2, 3) + comm.rank)   # unchanged
    assert list(y.devices()) == list(x.devices())
    h = comm.all_reduce(jnp.ones(4, jnp.bfloat16) * (comm.rank + 1), "avg")
    assert h.dtype == jnp.bfloat16 and np.allclose(np.asarray(h, np.float32), (comm.size + 1) / 2)
    b = comm.broadcast(jnp.full(3, comm.rank, jnp.int32), src=1)
    assert b.dtype == jnp.int32 and (np.asarray(b) == 1).all()
    with pytest.raises(anyccl.InvalidArgumentError, match="use what it returns"):
        comm.all_reduce(x, async_op=True)
    return True


def test_jax_arrays_on_the_host_reduce_into_new_jax_arrays():
    pytest.importorskip("jax")
    assert all(run_ranks(check_jax_arrays, 2))


def test_an_array_known_only_through_dlpack_is_used_in_place_and_a_foreign_device_refused():
    from arraykinds import DLPackOnly

    comm = anyccl.init("shm")
    x = np.arange(5.0)
    address = x.ctypes.data
    comm.all_reduce(DLPackOnly(x))   # one rank: the sum is x itself, written where x lies
    assert x.ctypes.data == address and (x == np.arange(5.0)).all()

    class OnSomeAccelerator(DLPackOnly):
        def __dlpack_device__(self):
            return (14, 0)   # DLPack's kDLOneAPI: neither host nor CUDA

    with pytest.raises(anyccl.UnsupportedError, match="DLPack array on device type 14"):
        comm.all_reduce(OnSomeAccelerator(x))
    comm.close()
