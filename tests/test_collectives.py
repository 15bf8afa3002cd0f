"""Every collective, every dtype, world sizes 1 to 4 and element counts from 0 to 1_048_579,
against NumPy. Staging halves of 256 KiB make the larger counts cross many chunks."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from arraykinds import FAKE_GPU, KINDS, as_kind, for_kind, has_dtype
from harness import run_ranks, suite_backend
from reference import (
    COUNTS,
    DTYPES,
    FAMILY_DTYPES,
    assert_matches,
    make_input,
    reduce_reference,
    valid_ops,
)

from anyccl import ReduceOp
from anyccl.buffers import BFLOAT16

WORLD_SIZES = (1, 2, 3, 4)
SMALL_STAGING = {"ANYCCL_SHM_STAGING_BYTES": str(256 << 10)}
# large messages take the single-copy path when cross-memory attach works; pin each path
PATHS = {"direct": SMALL_STAGING, "staging": {**SMALL_STAGING, "ANYCCL_SHM_CMA": "0"}}


def shm_path(path: str) -> None:
    """The two paths are the shm backend's; on another backend one run says it all."""
    if path == "staging" and suite_backend() != "shm":
        pytest.skip(f"the staging path is the shm backend's; {suite_backend()} ran 'direct'")


def cases(kind="numpy"):
    """(dtype, count) pairs: every dtype at the small counts, one per family at the large (those
    that arrays of `kind` hold)."""
    for count in COUNTS:
        for dtype in (DTYPES if count <= 1000 else FAMILY_DTYPES):
            if has_dtype(kind, np.dtype(dtype)):
                yield np.dtype(dtype), count


def check_all_reduce(comm, kind="numpy"):
    k, comm = functools.partial(as_kind, kind), for_kind(kind, comm)
    checked = 0
    for dtype, count in cases(kind):
        for op in valid_ops(dtype):
            x = make_input(comm.rank, count, dtype)
            comm.all_reduce(k(x), op=op)
            expected = reduce_reference([make_input(r, count, dtype) for r in range(comm.size)], op)
            assert_matches(x, expected, f"all_reduce {dtype} x {count} {op}")
            checked += 1
    return checked


def check_reduce(comm, kind="numpy"):
    k, comm = functools.partial(as_kind, kind), for_kind(kind, comm)
    for dtype, count in cases(kind):
        for op in valid_ops(dtype):
            root = (count + 1) % comm.size
            x = make_input(comm.rank, count, dtype)
            comm.reduce(k(x), dst=root, op=op)
            if comm.rank == root:
                expected = reduce_reference([make_input(r, count, dtype)
                                             for r in range(comm.size)], op)
            else:
                expected = make_input(comm.rank, count, dtype)  # untouched on other ranks
            assert_matches(x, expected, f"reduce {dtype} x {count} {op} root {root}")
    return True


def check_broadcast(comm, kind="numpy"):
    k, comm = functools.partial(as_kind, kind), for_kind(kind, comm)
    for dtype, count in cases(kind):
        root = count % comm.size
        x = make_input(comm.rank, count, dtype)
        comm.broadcast(k(x), src=root)
        assert_matches(x, make_input(root, count, dtype), f"broadcast {dtype} x {count}")
    return True


def check_all_gather(comm, kind="numpy"):
    k, comm = functools.partial(as_kind, kind), for_kind(kind, comm)
    for dtype, count in cases(kind):
        x = make_input(comm.rank, count, dtype)
        as_list = [np.empty(count, dtype) for _ in range(comm.size)]
        comm.all_gather(k(as_list), k(x))
        as_array = np.empty(comm.size * count, dtype)
        comm.all_gather(k(as_array), k(x))
        for r in range(comm.size):
            expected = make_input(r, count, dtype)
            assert_matches(as_list[r], expected, f"all_gather list {dtype} x {count} from {r}")
            assert_matches(as_array[r * count:(r + 1) * count], expected,
                           f"all_gather array {dtype} x {count} from {r}")
    return True


def check_gather(comm, kind="numpy"):
    k, comm = functools.partial(as_kind, kind), for_kind(kind, comm)
    for dtype, count in cases(kind):
        root = (count + 2) % comm.size
        outs = [np.empty(count, dtype) for _ in range(comm.size)] if comm.rank == root else None
        comm.gather(k(make_input(comm.rank, count, dtype)), k(outs), dst=root)
        if comm.rank == root:
            for r in range(comm.size):
                assert_matches(outs[r], make_input(r, count, dtype), f"gather {dtype} from {r}")
    return True


def check_scatter(comm, kind="numpy"):
    k, comm = functools.partial(as_kind, kind), for_kind(kind, comm)
    for dtype, count in cases(kind):
        root = (count + 3) % comm.size
        chunks = [make_input(r, count, dtype, salt=1) for r in range(comm.size)] \
            if comm.rank == root else None
        out = np.empty(count, dtype)
        comm.scatter(k(out), k(chunks), src=root)
        assert_matches(out, make_input(comm.rank, count, dtype, salt=1),
                       f"scatter {dtype} x {count}")
    return True


def check_reduce_scatter(comm, kind="numpy"):
    k, comm = functools.partial(as_kind, kind), for_kind(kind, comm)
    for dtype, count in cases(kind):
        for op in valid_ops(dtype):
            inputs = [make_input(comm.rank, count, dtype, salt=j) for j in range(comm.size)]
            out = np.empty(count, dtype)
            comm.reduce_scatter(k(out), k(inputs), op=op)
            expected = reduce_reference([make_input(r, count, dtype, salt=comm.rank)
                                         for r in range(comm.size)], op)
            assert_matches(out, expected, f"reduce_scatter {dtype} x {count} {op}")
            whole = np.concatenate(inputs) if count else np.empty(0, dtype)
            out2 = np.empty(count, dtype)
            comm.reduce_scatter(k(out2), k(whole), op=op)
            assert_matches(out2, expected, f"reduce_scatter (one array) {dtype} x {count} {op}")
    return True


def check_all_to_all(comm, kind="numpy"):
    k, comm = functools.partial(as_kind, kind), for_kind(kind, comm)
    for dtype, count in cases(kind):
        inputs = [make_input(comm.rank, count, dtype, salt=j) for j in range(comm.size)]
        outs = [np.empty(count, dtype) for _ in range(comm.size)]
        comm.all_to_all(k(outs), k(inputs))
        for j in range(comm.size):
            assert_matches(outs[j], make_input(j, count, dtype, salt=comm.rank),
                           f"all_to_all {dtype} x {count} from {j}")
        in_place = np.concatenate(inputs) if count else np.empty(0, dtype)
        comm.all_to_all(k(in_place), k(in_place))
        assert_matches(in_place, np.concatenate(outs) if count else in_place,
                       f"all_to_all in place {dtype} x {count}")
    return True


CHECKS = [check_all_reduce, check_reduce, check_broadcast, check_all_gather, check_gather,
          check_scatter, check_reduce_scatter, check_all_to_all]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_collective_matches_numpy(check, world_size, path):
    shm_path(path)
    assert all(run_ranks(check, world_size, env=PATHS[path], deadline_s=300))


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("numpy", "fakegpu")])
@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_collective_matches_numpy_over_every_array_kind(check, world_size, kind):
    """The whole matrix (ops x dtypes x counts) on torch CPU tensors and on arrays known only
    through DLPack, each sharing the NumPy memory the check reads."""
    pytest.importorskip("torch")
    assert all(run_ranks(check, world_size, kind, env=SMALL_STAGING, deadline_s=300))


@pytest.mark.shm_only   # the fake GPU's wire is its own shm backend
@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_collective_matches_numpy_on_gpu_arrays(check, world_size):
    """The whole matrix on GPU arrays of the simulated device: the GPU engine's path (checks,
    streams, events) carries every dtype, op and count that `__cuda_array_interface__` can
    describe."""
    assert all(run_ranks(check, world_size, "fakegpu", env={**SMALL_STAGING, **FAKE_GPU},
                         deadline_s=300))


def check_path(comm):
    return comm.host_backend.direct


@pytest.mark.shm_only
def test_cross_memory_attach_is_agreed_by_every_rank_and_can_be_turned_off():
    assert len(set(run_ranks(check_path, 3))) == 1
    assert run_ranks(check_path, 2, env={"ANYCCL_SHM_CMA": "0"}) == [False, False]


def check_default_staging_large(comm):
    """Default sizes (1 MiB staging halves): one 40 MiB all_reduce, broadcast and all_gather;
    returns whether the backend read peers directly (the single-copy path) or staged."""
    count = 10 * 1024 * 1024 + 3
    x = make_input(comm.rank, count, np.dtype(np.float32))
    comm.all_reduce(x)
    expected = reduce_reference([make_input(r, count, np.dtype(np.float32))
                                 for r in range(comm.size)], ReduceOp.SUM)
    assert_matches(x, expected, "all_reduce 40 MiB")
    y = make_input(comm.rank, count, np.dtype(np.float32))
    comm.broadcast(y, src=comm.size - 1)
    assert_matches(y, make_input(comm.size - 1, count, np.dtype(np.float32)), "broadcast 40 MiB")
    z = make_input(comm.rank, count, np.dtype(np.float32))
    out = np.empty(count * comm.size, np.float32)
    comm.all_gather(out, z)
    assert_matches(out, np.concatenate([make_input(r, count, np.dtype(np.float32))
                                        for r in range(comm.size)]), "all_gather 40 MiB")
    return getattr(comm.host_backend, "direct", None)


@pytest.mark.parametrize("world_size", (2, 3))
def test_messages_larger_than_the_staging_area_pipeline_through_it(world_size):
    # ANYCCL_SHM_CMA=0 keeps the shm backend off its single-copy path: every byte goes
    # through the 1 MiB staging halves (the mpi backend has neither and ignores it)
    paths = run_ranks(check_default_staging_large, world_size, env={"ANYCCL_SHM_CMA": "0"})
    assert all(p in (False, None) for p in paths), paths


def check_barrier_orders_ranks(comm):
    import time

    stamps = np.zeros(comm.size)
    if comm.rank == 0:
        time.sleep(0.2)
    before = time.monotonic()
    comm.barrier()
    stamps[comm.rank] = time.monotonic() - before
    return float(stamps[comm.rank])


def test_barrier_holds_every_rank_until_the_last_arrives():
    waited = run_ranks(check_barrier_orders_ranks, 3)
    assert min(waited[1:]) > 0.15, waited


def order_sensitive(rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Values over many orders of magnitude, of both signs: their floating-point sum depends on
    the order it is taken in."""
    rng = np.random.default_rng(1000 + rank)
    values = rng.standard_normal(count) * 10.0 ** rng.integers(-4, 5, count)
    return values.astype(dtype)


def check_reductions_are_bit_identical_on_every_rank(comm, count, dtype_name):
    import hashlib

    dtype = np.dtype(BFLOAT16 if dtype_name == "bfloat16" else dtype_name)
    inputs = [order_sensitive(r, count, dtype) for r in range(comm.size)]
    forward = inputs[0].copy()
    for a in inputs[1:]:
        forward = (forward + a).astype(dtype)
    backward = inputs[-1].copy()
    for a in inputs[-2::-1]:
        backward = (backward + a).astype(dtype)
    sensitive = comm.size < 3 or not np.array_equal(forward, backward)
    digests = []
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        x = inputs[comm.rank].copy()
        comm.all_reduce(x, op)
        digests.append(hashlib.sha256(x.tobytes()).hexdigest())
        out = np.empty(count, dtype)
        comm.reduce_scatter(out, np.concatenate([inputs[comm.rank]] * comm.size), op)
        everything = np.empty(count * comm.size, dtype)
        comm.all_gather(everything, out)
        digests.append(hashlib.sha256(everything.tobytes()).hexdigest())
    return sensitive, digests


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("count", (1000, 300_001))  # one shot; several chunks of two shots
@pytest.mark.parametrize("dtype_name", ("float32", "float16", "bfloat16"))
@pytest.mark.parametrize("world_size", (3, 4))
def test_order_dependent_sums_are_bit_identical_on_every_rank(world_size, dtype_name, count,
                                                              path):
    shm_path(path)
    results = run_ranks(check_reductions_are_bit_identical_on_every_rank, world_size, count,
                        dtype_name, env=PATHS[path])
    assert all(sensitive for sensitive, _ in results), "the inputs do not depend on the order"
    assert all(digests == results[0][1] for _, digests in results), \
        "ranks hold different results of one reduction"

