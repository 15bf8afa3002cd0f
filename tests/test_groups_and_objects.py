"""Sub-communicators (split, new_group) and object collectives."""

from __future__ import annotations

import numpy as np
from harness import run_ranks


def check_split_by_parity(comm):
    sub = comm.split(comm.rank % 2, key=-comm.rank)  # reversed order inside each group
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    assert sub.size == len(members)
    assert sub.rank == sorted(members, reverse=True).index(comm.rank)
    x = np.array([comm.rank], np.int64)
    sub.all_reduce(x)
    got = sub.all_gather_object(comm.rank)
    sub.close()
    return int(x[0]) == sum(members) and got == sorted(members, reverse=True)


def test_split_makes_independent_communicators_ordered_by_key():
    assert all(run_ranks(check_split_by_parity, 4))


def check_new_group(comm):
    group = comm.new_group([3, 1])
    if comm.rank not in (1, 3):
        return group is None
    assert group.size == 2 and group.rank == [1, 3].index(comm.rank)
    x = np.full(10, float(comm.rank))
    group.broadcast(x, src=1)  # group rank 1 is world rank 3
    comm_ok = True
    group.close()
    return comm_ok and (x == 3.0).all()


def test_new_group_contains_only_its_ranks_in_ascending_order():
    assert all(run_ranks(check_new_group, 4))


def check_parent_still_works_alongside_a_group(comm):
    group = comm.split(0 if comm.rank < 2 else None)
    x = np.ones(3)
    comm.all_reduce(x)
    if group is not None:
        y = np.ones(3)
        group.all_reduce(y)
        group.close()
        assert (y == 2).all()
    return bool((x == comm.size).all())


def test_parent_and_sub_communicators_interleave():
    assert all(run_ranks(check_parent_still_works_alongside_a_group, 3))


def check_objects(comm):
    obj = {"rank": comm.rank, "payload": list(range(comm.rank * 1000))}
    everyone = comm.all_gather_object(obj)
    assert [o["rank"] for o in everyone] == list(range(comm.size))
    assert all(len(o["payload"]) == o["rank"] * 1000 for o in everyone)
    root = comm.size - 1
    got = comm.broadcast_object(("hello", comm.rank) if comm.rank == root else None, src=root)
    return got == ("hello", root)


def test_object_collectives_carry_any_picklable_value():
    for world_size in (1, 2, 3):
        assert all(run_ranks(check_objects, world_size))
