"""The mpi backend's blocking sendrecv of NumPy arrays in one compiled call (backends/mpi.py:
`exchange_context`, `_shmcore.exchange` with the backend's MpiStep): where nothing of the
backend's is pending, the send leaves from a copy with MPI_Isend and the receive is posted with
MPI_Irecv, both from compiled code, under the tag that names the dtype. It must deliver what the
Python path delivers, in order, and keep every refusal of the Python path: a message of another
size or dtype, a receive not there within the spin (taken back with MPI_Cancel and posted the
general way), a send not delivered within the spin (handed over to the pending messages).
Runs in the mpi suite (ANYCCL_TEST_BACKEND=mpi, under mpiexec)."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_ranks, suite_backend

import anyccl

pytestmark = pytest.mark.skipif(suite_backend() != "mpi",
                                reason="the mpi backend's sendrecv (ANYCCL_TEST_BACKEND=mpi)")

DTYPES = ("float32", "float64", "int8", "uint16", "int64", "float16", "bool", "complex64")


def check_a_ring_of_exchanges(comm) -> tuple[list[str], int]:
    """Each rank sends to the next and receives from the one before, every dtype, sizes from
    0 to 256 KiB, tags 0 and 7: what arrived, and how many went through the compiled call
    (those up to mpi.exchange_max, 64 KiB)."""
    step = comm._hot[2]
    before = step.exchanges
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    wrong = []
    for name in DTYPES:
        dtype = np.dtype(name)
        for count in (0, 1, 7, (64 << 10) // dtype.itemsize, (64 << 10) // dtype.itemsize + 1,
                      (256 << 10) // dtype.itemsize):
            for tag in (0, 7):
                x = ((np.arange(count) * 3 + comm.rank + tag) % 100).astype(dtype)
                y = np.zeros(count, dtype)
                got = comm.sendrecv(x, right, y, left, tag)
                want = ((np.arange(count) * 3 + left + tag) % 100).astype(dtype)
                if got != left or not np.array_equal(y, want):
                    wrong.append(f"{name} x {count} tag {tag}")
    return wrong, step.exchanges - before


@pytest.mark.parametrize("n", [2, 3])
def test_a_ring_of_exchanges_delivers_every_dtype_through_the_compiled_call(n):
    for rank, (wrong, compiled) in enumerate(run_ranks(check_a_ring_of_exchanges, n)):
        assert wrong == [], (rank, wrong)
        # the four sizes up to 64 KiB of each dtype and tag, less those right after a larger
        # one whose buffered send was still pending (they order behind it, the general way)
        assert len(DTYPES) * 3 * 2 <= compiled <= len(DTYPES) * 4 * 2, (rank, compiled)


def check_mismatches(comm, case: str) -> str | None:
    peer = 1 - comm.rank
    x = np.ones(5, np.float32)
    y = np.zeros(5, np.float32)
    if case == "size" and comm.rank == 0:
        x = np.ones(9, np.float32)          # rank 1 receives 5 and is sent 9
    if case == "shorter" and comm.rank == 0:
        x = np.ones(3, np.float32)          # rank 1 receives 5 and is sent 3
    if case == "dtype" and comm.rank == 0:
        x = np.ones(5, np.int32)            # the same bytes, another dtype
    try:
        comm.sendrecv(x, peer, y, peer, 3)
    except anyccl.InvalidArgumentError as exc:
        error = str(exc)
    else:
        error = None
    z = np.full(4, comm.rank, np.int64)     # the communicator goes on
    w = np.zeros(4, np.int64)
    comm.sendrecv(z, peer, w, peer, 4)
    assert (w == peer).all(), w
    return error


@pytest.mark.parametrize("case", ["size", "shorter", "dtype"])
def test_a_message_of_another_size_or_dtype_is_refused_by_its_receiver(case):
    errors = run_ranks(check_mismatches, 2, case)
    assert errors[0] is None, errors[0]
    error = errors[1]
    assert error is not None and error.startswith("rank 1: sendrecv"), error
    assert "rank 0 sent" in error and "receiving array is float32 x 5" in error, error


def check_a_late_peer(comm) -> tuple[list[str], int]:
    """Rank 1 calls 0.3 s late, so rank 0's receive is not there within the spin (taken back,
    posted the general way); the same with a message past mpi.exchange_max (the Python path
    from the start)."""
    import time

    peer = 1 - comm.rank
    step = comm._hot[2]
    before = step.exchanges
    wrong = []
    for count in (3, 1 << 20):
        if comm.rank == 1:
            time.sleep(0.3)
        x = np.arange(count, dtype=np.float64) + comm.rank
        y = np.zeros(count)
        comm.sendrecv(x, peer, y, peer, 5)
        if not np.array_equal(y, np.arange(count) + peer):
            wrong.append(f"x {count}")
    comm.barrier()
    return wrong, step.exchanges - before


def test_a_late_peer_gets_the_same_messages_the_receive_taken_back_and_posted_again():
    for rank, (wrong, compiled) in enumerate(run_ranks(check_a_late_peer, 2)):
        assert wrong == [], (rank, wrong)
        assert compiled == 1, (rank, compiled)


def check_after_pending_sends(comm) -> list[float]:
    """A non-blocking send left pending keeps the next sendrecv on the general way, in order
    behind it; once it is done, sendrecv takes the compiled call again."""
    peer = 1 - comm.rank
    step = comm._hot[2]
    first = comm.isend(np.full(2, 1.0 + comm.rank), peer, 9)
    y = np.zeros(2)
    comm.sendrecv(np.full(2, 5.0 + comm.rank), peer, y, peer, 9)
    got = np.zeros(2)
    comm.recv(got, peer, 9)
    first.wait()
    before = step.exchanges
    z = np.zeros(2)
    comm.sendrecv(np.full(2, 7.0), peer, z, peer, 9)
    return [float(y[0]), float(got[0]), float(z[0]), float(step.exchanges - before)]


def test_messages_keep_their_order_behind_pending_ones():
    for rank, values in enumerate(run_ranks(check_after_pending_sends, 2)):
        peer = 1 - rank
        assert values == [1.0 + peer, 5.0 + peer, 7.0, 1.0], (rank, values)


def check_a_send_not_delivered_within_the_spin(comm) -> tuple[list[float], int]:
    """With mpi.exchange_max raised to 4 MiB: rank 0's 2 MiB send (past MPI's eager size) is
    not delivered within its spin since rank 1 calls 0.3 s late: handed over to the pending
    messages (as post_send's), delivered once rank 1 receives it."""
    import time

    peer = 1 - comm.rank
    step = comm._hot[2]
    before = step.exchanges
    if comm.rank == 1:
        time.sleep(0.3)
    x = np.full(1 << 18, comm.rank + 1.0)
    y = np.zeros(1 << 18)
    comm.sendrecv(x, peer, y, peer, 6)
    comm.barrier()
    return [float(y.min()), float(y.max())], step.exchanges - before


def test_a_send_not_delivered_within_the_spin_is_handed_over_and_delivered():
    outcomes = run_ranks(check_a_send_not_delivered_within_the_spin, 2,
                         env={"ANYCCL_TUNING": "mpi.exchange_max=4M"})
    for rank, (values, compiled) in enumerate(outcomes):
        assert values == [2.0 - rank] * 2, (rank, values)
        assert compiled == 1, (rank, compiled)
