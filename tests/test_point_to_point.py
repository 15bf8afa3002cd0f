"""send/recv/isend/irecv: tags, ordering, many in flight, and exchanges that must not deadlock."""

from __future__ import annotations

import re

import numpy as np
import pytest
from harness import run_ranks, run_ranks_outcomes, suite_backend
from reference import DTYPES, make_input

import anyccl


def check_every_dtype_and_size_arrives_intact(comm):
    peer = 1 - comm.rank
    for dtype in DTYPES:
        for count in (0, 1, 7, 1000, 1_048_579):
            x = make_input(comm.rank, count, np.dtype(dtype))
            got = np.empty(count, dtype)
            if comm.rank == 0:
                comm.send(x, peer)
                comm.recv(got, peer)
            else:
                comm.recv(got, peer)
                comm.send(x, peer)
            assert np.array_equal(got.view(np.uint8), make_input(peer, count, np.dtype(dtype))
                                  .view(np.uint8)), (dtype, count)
    return True


def test_send_recv_delivers_every_dtype_and_size():
    assert all(run_ranks(check_every_dtype_and_size_arrives_intact, 2))


def check_tags_select_messages_in_any_order(comm):
    if comm.rank == 0:
        for tag in range(5):
            comm.send(np.full(100_000, tag, np.int64), 1, tag=tag)
        return True
    got = {}
    for tag in (4, 2, 0, 3, 1):  # the reverse of the send order, messages larger than the ring
        x = np.empty(100_000, np.int64)
        comm.recv(x, 0, tag=tag)
        got[tag] = int(x[0]) if (x == x[0]).all() else -1
    return got == {t: t for t in range(5)}


def test_tags_match_receives_regardless_of_order():
    assert all(run_ranks(check_tags_select_messages_in_any_order, 2))


def check_same_tag_never_overtakes(comm):
    if comm.rank == 0:
        works = [comm.isend(np.full(1000 * (i % 3 + 1), i, np.int32), 1, tag=7) for i in range(40)]
        for w in works:
            w.wait()
        return True
    order = []
    for i in range(40):
        x = np.empty(1000 * (i % 3 + 1), np.int32)
        comm.recv(x, 0, tag=7)
        order.append(int(x[0]))
    return order == list(range(40))


def test_messages_with_one_tag_arrive_in_send_order():
    assert all(run_ranks(check_same_tag_never_overtakes, 2))


def check_sixteen_in_flight(comm):
    n, count = 16, 50_000
    peer = (comm.rank + 1) % comm.size
    prev = (comm.rank - 1) % comm.size
    recvs = [np.empty(count, np.float64) for _ in range(n)]
    works = [comm.irecv(recvs[i], prev, tag=i) for i in range(n)]
    # no rank sends before every rank has reached the barrier below, this one included
    assert not any(w.is_completed() for w in works), "a receive completed with nothing sent"
    comm.barrier()
    works += [comm.isend(np.full(count, comm.rank * 100 + i, np.float64), peer, tag=i)
              for i in range(n)]
    for w in works:
        assert w.wait() is True
        assert w.is_completed() and w.exception() is None
    return all((recvs[i] == prev * 100 + i).all() for i in range(n))


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_sixteen_async_messages_in_flight_around_a_ring(world_size):
    assert all(run_ranks(check_sixteen_in_flight, world_size))


def check_head_to_head_large_sends(comm):
    """Both ranks send 32 MiB first and receive after: larger than any buffer, must not hang."""
    peer = 1 - comm.rank
    mine = np.full(4 << 20, comm.rank, np.float64)
    w = comm.isend(mine, peer)
    got = np.empty_like(mine)
    comm.recv(got, peer)
    w.wait()
    return bool((got == peer).all())


def test_simultaneous_large_sends_do_not_deadlock():
    assert all(run_ranks(check_head_to_head_large_sends, 2))


def check_recv_posted_before_send(comm):
    peer = 1 - comm.rank
    got = np.empty(3_000_000, np.float32)
    w = comm.irecv(got, peer, tag=1)
    comm.send(np.full(3_000_000, comm.rank, np.float32), peer, tag=1)
    w.wait(timeout=60)
    return bool((got == peer).all())


def test_receives_posted_first_complete_when_the_send_comes():
    assert all(run_ranks(check_recv_posted_before_send, 2))


@pytest.mark.shm_only   # the shm transport's message rings
@pytest.mark.parametrize("check", [check_every_dtype_and_size_arrives_intact,
                                   check_tags_select_messages_in_any_order,
                                   check_recv_posted_before_send])
def test_messages_many_times_a_ring_stream_through_it_in_pieces(check):
    """With 4 KiB rings every message above streams through in 1 KiB pieces, the sender
    refilling what the receiver read while it reads on; messages arrive whole, in order, by
    tag, also into receives posted first."""
    assert all(run_ranks(check, 2, env={"ANYCCL_SHM_CHANNEL_BYTES": "4096"}))


def check_size_mismatch(comm):
    if comm.rank == 0:
        comm.send(np.zeros(10, np.float32), 1, tag=3)
        comm.send(np.arange(4, dtype=np.int64), 1, tag=4)
        return "sent"
    try:
        comm.recv(np.empty(12, np.float32), 0, tag=3)
    except anyccl.InvalidArgumentError as exc:
        message = str(exc)
    else:
        return "no error"
    after = np.empty(4, np.int64)
    comm.recv(after, 0, tag=4)  # the communicator still works
    return message if (after == np.arange(4)).all() else "corrupt"


def test_receiving_into_a_wrong_sized_array_is_a_clear_error():
    _, message = run_ranks(check_size_mismatch, 2)
    assert "rank 0 sent float32 x 10" in message and "float32 x 12" in message, message


def check_large_messages_are_read_out_of_the_sender(comm):
    """Rank 0 sends messages larger than its ring (and small ones); rank 1 reads each
    straight out of rank 0's memory, whether its receive was posted first (a) or the message
    came while it waited for another (b), and refuses one of another size (c). Received in
    another order than sent (d), each still gets its own data; one whose receive comes only
    after its sender's blocking send returned (e) is still delivered whole. Returns rank 1's
    results, or on rank 0 the bytes its ring carried."""
    from anyccl.errors import InvalidArgumentError

    b = comm._engine.backend
    if not b.direct:
        return "no cross-memory attach"
    peer, n = 1 - comm.rank, 4 << 20      # 16 MiB of float32: > the ring, >= direct_min
    big = np.arange(n, dtype=np.float32) + 1
    if comm.rank == 0:
        before = b._sent[peer]
        comm.barrier()
        comm.send(big, peer, tag=1)                     # (a)
        work = comm.isend(big * 2, peer, tag=2)         # (b), then a small one
        comm.send(np.ones(2, np.float32), peer, tag=3)
        work.wait()
        comm.send(big, peer, tag=4)                     # (c)
        work = comm.isend(big * 3, peer, tag=5)         # (d)
        comm.send(big * 4, peer, tag=6)
        work.wait()
        comm.send(big * 5, peer, tag=7)                 # (e): no receive for it yet
        comm.send(np.ones(2, np.float32), peer, tag=8)
        comm.barrier()
        return b._sent[peer] - before
    got = np.zeros(n, np.float32)
    posted = comm.irecv(got, peer, tag=1)
    comm.barrier()
    posted.wait()
    first = bool((got == big).all())
    comm.recv(np.empty(2, np.float32), peer, tag=3)    # (b) arrived meanwhile, then this
    comm.recv(got, peer, tag=2)
    second = bool((got == big * 2).all())
    try:
        comm.recv(np.zeros(n // 2, np.float32), peer, tag=4)
        refused = "no error"
    except InvalidArgumentError as exc:
        refused = str(exc)
    comm.recv(got, peer, tag=6)                         # (d)
    fourth = bool((got == big * 4).all())
    comm.recv(got, peer, tag=5)
    fourth &= bool((got == big * 3).all())
    comm.recv(np.empty(2, np.float32), peer, tag=8)     # (e): rank 0's send of tag 7 returned
    comm.recv(got, peer, tag=7)
    fifth = bool((got == big * 5).all())
    comm.barrier()                                      # rank 0's sends completed
    return first, second, refused, fourth, fifth


@pytest.mark.skipif(suite_backend() != "shm", reason="the shm backend's direct messages")
def test_a_message_larger_than_its_ring_is_read_straight_out_of_the_sender():
    carried, got = run_ranks(check_large_messages_are_read_out_of_the_sender, 2)
    if carried == "no cross-memory attach":
        pytest.skip("cross-memory attach is not usable here")
    assert carried == 6 * 32 + 2 * 64   # six headers and the two small messages: no data
    first, second, refused, fourth, fifth = got
    assert first and second and fourth and fifth
    assert "float32 x 4194304" in refused and "float32 x 2097152" in refused, refused


def check_torch_tensors(comm):
    import torch

    peer = 1 - comm.rank
    t = torch.arange(6, dtype=torch.bfloat16) * (comm.rank + 1)
    got = torch.empty(6, dtype=torch.bfloat16)
    w = comm.isend(t, peer)
    comm.recv(got, peer)
    w.wait()
    return bool(torch.equal(got, torch.arange(6, dtype=torch.bfloat16) * (peer + 1)))


def test_torch_cpu_tensors_travel_zero_copy():
    pytest.importorskip("torch")
    assert all(run_ranks(check_torch_tensors, 2))


def check_recv_without_send_times_out(comm):
    import time

    comm_timeout = comm.timeout_s
    comm.timeout_s = 1.0  # this communicator only, for this check
    try:
        if comm.rank == 1:
            start = time.monotonic()
            try:
                comm.recv(np.empty(3, np.float32), 0)
            except anyccl.TimeoutError as exc:
                return str(exc), time.monotonic() - start
            return "no error", 0
        return "idle", 0
    finally:
        comm.timeout_s = comm_timeout


def test_a_recv_with_no_matching_send_fails_with_a_timeout_that_names_it():
    outcomes = run_ranks_outcomes(check_recv_without_send_times_out, 2)
    message, waited = outcomes[1]
    assert re.match(r"rank 1: recv\(src=0, tag=0, 12 B\) #\d+ timed out after 1 s", message), \
        message
    if suite_backend() == "shm":  # shm shows each peer's state; MPI cannot see it
        assert re.search(r"rank 0 (is idle after \w+\(.*\) #\d+|has started no operation yet)",
                         message), message
    assert 0.9 < waited < 5


def check_a_sendrecv_whose_send_went_is_still_in_it(comm):
    """Rank 0's sendrecv sends a message larger than its ring (so the send is posted and
    finishes only as rank 1 drains it) and waits for a receive that never comes; rank 1 waits
    for a message that never comes either. When rank 1 times out, rank 0 is still in its
    sendrecv, although its send is done."""
    comm_timeout = comm.timeout_s
    try:
        if comm.rank == 0:
            comm.timeout_s = 4.0
            big = np.ones(3 << 20, np.uint8)   # 3 MiB: more than the 1 MiB ring
            try:
                comm.sendrecv(big, 1, np.empty(4, np.float32), 1, tag=5)
            except anyccl.TimeoutError as exc:
                return str(exc)
            return "no error"
        comm.timeout_s = 1.5
        try:
            comm.recv(np.empty(3, np.float32), 0, tag=6)
        except anyccl.TimeoutError as exc:
            return str(exc)
        return "no error"
    finally:
        comm.timeout_s = comm_timeout


@pytest.mark.shm_only   # shm shows each peer's state; MPI cannot see it
def test_a_peer_waiting_in_a_sendrecv_is_named_as_in_it_after_its_send_went():
    outcomes = run_ranks_outcomes(check_a_sendrecv_whose_send_went_is_still_in_it, 2,
                                  env={"ANYCCL_SHM_CMA": "0"})
    message = outcomes[1]
    assert "timed out" in message and "rank 0 is in sendrecv(" in message, message


def check_receives_from_any_rank(comm):
    """Rank 0 receives from whichever rank's message comes; each sender's messages still arrive
    in the order it sent them, a message with another tag is left for its own receive, and an
    irecv's Work names the sender."""
    n, tag = comm.size, 5
    if comm.rank != 0:
        comm.send(np.full(7, -1.0), 0, tag=6)               # another tag: not taken below
        for k in range(2):
            comm.send(np.full(100_000, 100.0 * comm.rank + k), 0, tag=tag)  # beyond the ring
        return None
    heard = {}
    for _ in range(2 * (n - 1)):
        x = np.empty(100_000)
        sender = comm.recv(x, None, tag=tag)
        assert (x == x[0]).all() and int(x[0]) // 100 == sender, (sender, x[0])
        heard.setdefault(sender, []).append(int(x[0]) % 100)
    others = []
    for _ in range(n - 1):
        y = np.empty(7)
        work = comm.irecv(y, None, tag=6)
        work.wait()
        others.append((work.source, float(y[0])))
    return heard, sorted(others)


@pytest.mark.parametrize("world_size", (2, 4))
def test_a_receive_from_any_rank_takes_each_message_once_and_names_its_sender(world_size):
    heard, others = run_ranks(check_receives_from_any_rank, world_size)[0]
    assert heard == {r: [0, 1] for r in range(1, world_size)}
    assert others == [(r, -1.0) for r in range(1, world_size)]


def check_earliest_posted_receive_takes_the_message(comm):
    if comm.rank == 1:
        for value in (10, 11):
            comm.send(np.array([value], np.int64), 0, tag=2)
        return None
    if comm.rank == 0:
        anyone, named = np.zeros(1, np.int64), np.zeros(1, np.int64)
        first = comm.irecv(anyone, None, tag=2)   # posted first: takes the first message
        second = comm.irecv(named, 1, tag=2)
        first.wait()
        second.wait()
        return int(anyone[0]), first.source, int(named[0]), second.source
    return None


def test_the_earliest_posted_receive_that_fits_takes_a_message_as_in_mpi():
    assert run_ranks(check_earliest_posted_receive_takes_the_message, 3)[0] == (10, 1, 11, 1)


def check_sendrecv_around_a_ring(comm):
    """Every rank sends right and receives from the left in one call: small messages (whole in
    the ring), messages larger than the ring, every dtype, and a receive from any rank."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for dtype in DTYPES:
        for count in (0, 1, 33, 300_001):
            got = np.empty(count, dtype)
            sender = comm.sendrecv(make_input(comm.rank, count, np.dtype(dtype)), right, got,
                                   left, tag=count)
            want = make_input(left, count, np.dtype(dtype))
            assert sender == left and np.array_equal(got.view(np.uint8), want.view(np.uint8)), \
                (dtype, count)
    got = np.empty(5, np.int64)
    sender = comm.sendrecv(np.full(5, comm.rank, np.int64), right, got, None, tag=9)
    return sender == left and bool((got == left).all())


@pytest.mark.parametrize("world_size", (2, 4))
def test_sendrecv_exchanges_around_a_ring_without_deadlock(world_size):
    assert all(run_ranks(check_sendrecv_around_a_ring, world_size))


def check_sendrecv_refusals(comm):
    peer = 1 - comm.rank
    x = np.zeros(8, np.float32)
    messages = []
    for call in (lambda: comm.sendrecv(x, peer, x[2:6], peer),     # overlapping arrays
                 lambda: comm.sendrecv(x, None, np.zeros(8, np.float32), peer),
                 lambda: comm.sendrecv(x, comm.rank, np.zeros(8, np.float32), peer)):
        try:
            call()
        except anyccl.InvalidArgumentError as exc:
            messages.append(str(exc))
    with comm.batch():
        try:
            comm.sendrecv(x, peer, np.zeros(8, np.float32), peer)
        except anyccl.InvalidArgumentError as exc:
            messages.append(str(exc))
    got = np.empty(8, np.float32)   # nothing was sent by the refused calls: this is the first
    comm.sendrecv(np.full(8, comm.rank, np.float32), peer, got, peer)
    return messages, bool((got == peer).all())


def test_sendrecv_refuses_overlapping_arrays_missing_or_own_ranks_and_batches():
    for messages, intact in run_ranks(check_sendrecv_refusals, 2):
        assert intact and len(messages) == 4, messages
        assert "send_tensor and recv_tensor overlap" in messages[0], messages[0]
        assert "dst=None" in messages[1], messages[1]
        assert "is this rank" in messages[2], messages[2]
        assert "inside `with comm.batch():`" in messages[3], messages[3]


def check_messages_already_there_are_taken_at_once_in_order(comm):
    """Small messages that arrived before their irecv: each irecv takes the next one in send
    order; with shm's compiled core it is complete when irecv returns."""
    if comm.rank == 0:
        for i in range(3):
            comm.send(np.full(4, i, np.int32), 1, tag=1)
        comm.barrier()
        return True
    comm.barrier()   # every message is in the ring by now
    got = [np.empty(4, np.int32) for _ in range(3)]
    works = [comm.irecv(g, 0, tag=1) for g in got]
    at_once = [w.is_completed() for w in works]
    for w in works:
        w.wait()
    assert [int(g[0]) for g in got] == [0, 1, 2] and all(w.source == 0 for w in works)
    from anyccl.backends import shm

    compiled = comm.backend == "shm" and "compiled core built" in shm.status()
    return all(at_once) if compiled else True


def test_an_irecv_takes_a_message_that_already_arrived_at_once_and_in_send_order():
    assert all(run_ranks(check_messages_already_there_are_taken_at_once_in_order, 2))


def check_progress_while_the_sender_computes(comm):
    """Rank 0 starts a send larger than its ring and then computes for 2 s without calling
    anyccl; rank 1's blocking receive must not wait for that to end: posted messages progress
    on the engine's own thread, whether it was idle for long (parked) or busy a moment ago."""
    import time

    big = np.full(4_000_000, 7.0, np.float32)   # 16 MB: many rings' worth
    took = []
    for rest_s in (0.5, 0.0):   # the worker parked after a long idle, then one just busy
        comm.barrier()
        time.sleep(rest_s)
        if comm.rank == 0:
            work = comm.isend(big, 1, tag=5)
            time.sleep(2.0)          # computing: no anyccl call
            took.append(work.is_completed())
            work.wait(timeout=30)
        else:
            got = np.zeros_like(big)
            start = time.monotonic()
            comm.recv(got, 0, tag=5)
            took.append(time.monotonic() - start < 1.5 and bool((got == 7.0).all()))
    return took


@pytest.mark.shm_only
def test_a_posted_send_progresses_while_its_caller_computes():
    sender, receiver = run_ranks(check_progress_while_the_sender_computes, 2)
    assert sender == [True, True] and receiver == [True, True], (sender, receiver)


def check_a_held_receive_keeps_its_place_and_completes_when_polled(comm):
    """A small irecv is held by its engine rather than posted (engine.held_recv_max), here
    before its message has come: it must still take the first message, before a later receive,
    complete when polled with is_completed() alone, and complete under wait(timeout)."""
    import time

    if comm.rank == 0:
        go = np.empty(1, np.int64)
        comm.recv(go, 1, tag=2)             # rank 1's irecvs are issued
        comm.send(np.full(3, 1.0), 1, tag=1)
        comm.send(np.full(3, 2.0), 1, tag=1)
        comm.recv(go, 1, tag=2)
        time.sleep(0.2)                     # rank 1 polls meanwhile
        comm.send(np.full(3, 3.0), 1, tag=1)
        comm.recv(go, 1, tag=2)
        comm.send(np.full(3, 4.0), 1, tag=1)
        return True
    first, second = np.zeros(3), np.zeros(3)
    work = comm.irecv(first, 0, tag=1)      # held: nothing sent yet
    comm.send(np.ones(1, np.int64), 0, tag=2)
    comm.recv(second, 0, tag=1)             # a later receive: the held one goes first
    work.wait()
    in_order = first[0] == 1.0 and second[0] == 2.0
    polled = np.zeros(3)
    work = comm.irecv(polled, 0, tag=1)
    comm.send(np.ones(1, np.int64), 0, tag=2)
    deadline = time.monotonic() + 10
    while not work.is_completed() and time.monotonic() < deadline:
        pass
    polled_in_time = work.is_completed() and polled[0] == 3.0
    timed = np.zeros(3)
    work2 = comm.irecv(timed, 0, tag=1)
    comm.send(np.ones(1, np.int64), 0, tag=2)
    work2.wait(timeout=10)
    return (in_order, polled_in_time, timed[0] == 4.0)


def test_a_small_receive_held_by_its_engine_keeps_its_place_and_completes_when_polled():
    outcomes = run_ranks(check_a_held_receive_keeps_its_place_and_completes_when_polled, 2)
    assert outcomes[1] == (True, True, True), outcomes


def check_held_receives_whose_messages_came_first_and_one_across_a_collective(comm):
    """A small irecv is held whether or not its message has arrived: held receives still take
    the messages in the order they were issued (a later irecv settles the held one first), and
    a collective issued while one is held runs, the receive taking its message afterwards."""
    if comm.rank == 1:
        comm.send(np.full(3, 1.0), 0, tag=1)
        comm.send(np.full(3, 2.0), 0, tag=1)
        comm.barrier()
        comm.all_reduce(np.ones(2))
        comm.send(np.full(3, 3.0), 0, tag=1)
        return True
    comm.barrier()                          # both messages are there
    a, b = np.zeros(3), np.zeros(3)
    first = comm.irecv(a, 1, tag=1)
    second = comm.irecv(b, 1, tag=1)
    second.wait()
    first.wait()
    later = np.zeros(3)
    held = comm.irecv(later, 1, tag=1)      # rank 1 sends it after the all_reduce
    total = np.ones(2)
    comm.all_reduce(total)
    held.wait()
    return (a[0], b[0], total[0], later[0])


def test_held_receives_keep_their_order_when_their_messages_came_first_and_across_a_collective():
    outcomes = run_ranks(check_held_receives_whose_messages_came_first_and_one_across_a_collective,
                         2)
    assert outcomes[0] == (1.0, 2.0, 2.0, 3.0), outcomes


def check_a_held_receive_keeps_its_place_while_another_thread_drives(comm):
    """Rank 0 holds a small irecv, then another of its threads blocks in a send larger than
    the ring (driving the transport while it waits), and a second irecv for the same source
    comes meanwhile: the held one, which cannot be settled on this thread then, is queued
    ahead of it, so the two take rank 1's two messages in order."""
    import threading
    import time

    big = np.arange(1 << 20, dtype=np.float32)   # 4 MiB: more than the ring
    if comm.rank == 1:
        time.sleep(0.5)
        comm.send(np.full(3, 1.0), 0, tag=1)
        comm.send(np.full(3, 2.0), 0, tag=1)
        got = np.zeros_like(big)
        comm.recv(got, 0, tag=9)
        return bool((got == big).all())
    first, second = np.zeros(3), np.zeros(3)
    held = comm.irecv(first, 1, tag=1)
    sender = threading.Thread(target=comm.send, args=(big, 1), kwargs={"tag": 9})
    sender.start()
    time.sleep(0.2)                          # the sender drives, waiting for rank 1
    later = comm.irecv(second, 1, tag=1)
    held.wait(timeout=30)
    later.wait(timeout=30)
    sender.join(timeout=30)
    return (first[0], second[0]) == (1.0, 2.0) and not sender.is_alive()


def test_a_held_receive_keeps_its_place_while_another_thread_drives():
    assert run_ranks(check_a_held_receive_keeps_its_place_while_another_thread_drives, 2) \
        == [True, True]


def check_a_sendrecv_whose_receive_comes_late(comm):
    """Rank 0's send goes at once; the message it receives comes 0.3 s later, past the spin of
    the fast path: the exchange waits for it and ends done."""
    import time

    if comm.rank == 1:
        time.sleep(0.3)
    got = np.zeros(3)
    sender = comm.sendrecv(np.full(3, float(comm.rank + 1)), 1 - comm.rank, got, 1 - comm.rank,
                           tag=4)
    record = comm.flight_recorder.records()[-1]
    return (sender, got[0], record.name, record.state)


def test_a_sendrecv_whose_receive_comes_late_waits_for_it():
    assert run_ranks(check_a_sendrecv_whose_receive_comes_late, 2) == [
        (1, 2.0, "sendrecv", "done"), (0, 1.0, "sendrecv", "done")]
