"""Every bad argument raises a specific error on the calling rank before any byte moves, and
the communicator stays usable: each check below is followed by a working collective. A rank
that refuses its arguments to a collective tells the others, which raise too (naming it and
its reason) instead of pairing their call with its next one."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_ranks

import anyccl

F4 = np.float32


def _ones(n=4, dtype=F4):
    return np.ones(n, dtype)


def _read_only():
    a = _ones()
    a.flags.writeable = False
    return a


# (call made on rank 0 only, error type, words the message must contain)
BAD_CALLS = {
    "elements_share_memory": (lambda c: c.all_reduce(np.lib.stride_tricks.as_strided(
        _ones(), (4, 4), (0, 4))), anyccl.InvalidArgumentError, "tensor (a NumPy array) has "
        "elements that share memory (shape (4, 4), strides (0, 4)), so it cannot receive a result"),
    "read_only_output": (lambda c: c.all_gather(_read_only(), _ones(2)),
                         anyccl.InvalidArgumentError, "out (a NumPy array) is read-only"),
    "read_only_input_async": (lambda c: c.all_reduce(_read_only(), async_op=True),
                              anyccl.InvalidArgumentError, "cannot be written in place, so "
                              "async_op=True has nowhere to put the result"),
    "python_scalar": (lambda c: c.all_reduce(3.0), anyccl.InvalidArgumentError,
                      "Python float"),
    "object_dtype": (lambda c: c.all_reduce(np.array([object()])), anyccl.UnsupportedError,
                     "dtype object"),
    "avg_on_integers": (lambda c: c.all_reduce(np.ones(3, np.int32), op=anyccl.ReduceOp.AVG),
                        anyccl.UnsupportedError, "AVG needs a floating"),
    "bitwise_on_floats": (lambda c: c.all_reduce(_ones(), op="bxor"), anyccl.UnsupportedError,
                          "bitwise"),
    "max_on_complex": (lambda c: c.all_reduce(np.ones(2, np.complex64), op="max"),
                       anyccl.UnsupportedError, "complex"),
    "unknown_op": (lambda c: c.all_reduce(_ones(), op="median"), anyccl.UnsupportedError,
                   "not a reduce op"),
    "broadcast_src_out_of_range": (lambda c: c.broadcast(_ones(), src=7),
                                   anyccl.InvalidArgumentError, "src=7 is out of range"),
    "negative_dst": (lambda c: c.reduce(_ones(), dst=-1), anyccl.InvalidArgumentError,
                     "dst=-1 is out of range"),
    "rank_not_int": (lambda c: c.broadcast(_ones(), src=1.0), anyccl.InvalidArgumentError,
                     "must be an int rank"),
    "send_to_self": (lambda c: c.send(_ones(), dst=0), anyccl.InvalidArgumentError,
                     "cannot message itself"),
    "negative_tag": (lambda c: c.send(_ones(), dst=1, tag=-1), anyccl.InvalidArgumentError,
                     "tag=-1"),
    "all_gather_list_too_short": (lambda c: c.all_gather([_ones()], _ones()),
                                  anyccl.InvalidArgumentError, "has 1 entries; expected one per"),
    "all_gather_wrong_dtype": (lambda c: c.all_gather([_ones(4, np.float64)] * 2, _ones()),
                               anyccl.InvalidArgumentError, "dtype float64; expected float32"),
    "all_gather_wrong_total": (lambda c: c.all_gather(_ones(7), _ones()),
                               anyccl.InvalidArgumentError, "expected 2 x 4 = 8"),
    "all_gather_overlap": (lambda c: (lambda out: c.all_gather(out, out[4:8]))(_ones(8)),
                           anyccl.InvalidArgumentError, "overlap"),
    "reduce_scatter_wrong_size": (lambda c: c.reduce_scatter(_ones(3), _ones(8)),
                                  anyccl.InvalidArgumentError, "expected 2 x 3 = 6"),
    "reduce_scatter_whole_wrong_dtype": (lambda c: c.reduce_scatter(_ones(), _ones(8, np.float64)),
                                         anyccl.InvalidArgumentError,
                                         "inp has dtype float64; expected float32"),
    "all_to_all_indivisible": (lambda c: c.all_to_all(_ones(5), _ones(5)),
                               anyccl.InvalidArgumentError, "not divisible"),
    "scatter_without_chunks_on_src": (lambda c: c.scatter(_ones(), None, src=0),
                                      anyccl.InvalidArgumentError, "chunks is None on the src"),
    "gather_list_on_non_root": (lambda c: c.gather(_ones(), [_ones(), _ones()], dst=1),
                                anyccl.InvalidArgumentError, "must be None on ranks other"),
    "split_bad_color": (lambda c: c.split(-3), anyccl.InvalidArgumentError, "color=-3"),
    "new_group_duplicates": (lambda c: c.new_group([1, 1]), anyccl.InvalidArgumentError,
                             "distinct ranks"),
}


# refused on the calling rank alone: no other rank was to meet it in this call
LOCAL_ONLY = {"send_to_self", "negative_tag", "split_bad_color", "new_group_duplicates"}


def check_bad_call_then_usable(comm, name):
    call, kind, words = BAD_CALLS[name]
    error = None
    if comm.rank == 0:
        try:
            call(comm)
        except Exception as exc:  # judged below, after the collective every rank joins
            error = exc
    elif name not in LOCAL_ONLY:  # the other ranks call the collective with good arguments
        with pytest.raises(anyccl.CollectiveMismatchError) as told:
            comm.all_reduce(np.ones(4))
        text = str(told.value)
        assert text.startswith(f"rank {comm.rank}: "), text
        assert "rank 0 refused its arguments" in text and words in text, text
    x = np.full(3, comm.rank + 1.0)
    comm.all_reduce(x)  # the communicator stays usable, and no rank saw a half-started op
    assert (x == 3.0).all()
    if comm.rank == 0:
        assert isinstance(error, kind), repr(error)
        assert isinstance(error, anyccl.AnycclError)
        assert str(error).startswith("rank 0: "), str(error)
        assert words in str(error), str(error)
    return True


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_argument_is_refused_before_any_byte_moves(name):
    assert all(run_ranks(check_bad_call_then_usable, 2, name))


def test_errors_are_the_python_types_users_expect():
    assert issubclass(anyccl.InvalidArgumentError, ValueError)
    assert issubclass(anyccl.UnsupportedError, TypeError)
    assert issubclass(anyccl.TimeoutError, TimeoutError)
    for cls in (anyccl.InvalidArgumentError, anyccl.UnsupportedError, anyccl.TimeoutError,
                anyccl.PeerLostError, anyccl.CollectiveMismatchError,
                anyccl.CommunicatorClosedError, anyccl.RendezvousError,
                anyccl.NotInitializedError):
        assert issubclass(cls, anyccl.AnycclError)


def test_init_refuses_inconsistent_rank_and_world_size():
    with pytest.raises(anyccl.InvalidArgumentError, match="rank=5"):
        anyccl.init(rank=5, world_size=2)
    with pytest.raises(anyccl.UnsupportedError, match="available: shm"):
        anyccl.init(backend="carrier-pigeon")


def check_closed_communicator_refuses(comm):
    sub = comm.split(0)
    sub.close()
    sub.close()  # idempotent
    with pytest.raises(anyccl.CommunicatorClosedError, match="closed"):
        sub.all_reduce(np.ones(2))
    return True


def test_a_closed_communicator_refuses_further_calls():
    assert all(run_ranks(check_closed_communicator_refuses, 2))
