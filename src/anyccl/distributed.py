"""torch.distributed's functions, over anyccl: change ``import torch.distributed as dist`` to
``import anyccl.distributed as dist`` and a CPU script runs unchanged.

Names, argument names and argument order follow torch.distributed. ``backend="gloo"`` means our
shared-memory backend. ``group`` arguments take communicators returned by `new_group`; a rank
outside a group gets `GroupMember.NON_GROUP_MEMBER` from `new_group`, and calls with it do
nothing on that rank, as in torch.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from .algorithms.uneven import split_elements
from .bootstrap import init
from .communicator import Communicator
from .errors import NotInitializedError
from .ops import ReduceOp
from .work import Work

__all__ = [
    "init_process_group", "destroy_process_group", "is_initialized", "is_available",
    "get_rank", "get_world_size", "get_backend", "new_group", "barrier", "send", "recv", "isend",
    "irecv", "broadcast", "scatter", "gather", "reduce", "all_reduce", "all_gather",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "broadcast_object_list", "all_gather_object", "ReduceOp", "GroupMember",
    "Work", "all_gather_single", "reduce_scatter_single", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list", "P2POp", "batch_isend_irecv", "monitored_barrier",
]


class GroupMember:
    WORLD: Communicator | None = None
    NON_GROUP_MEMBER = object()


def _group(group: Any) -> Communicator | None:
    if group is GroupMember.NON_GROUP_MEMBER:
        warnings.warn("this rank is not in the group it passed; the call does nothing here",
                      stacklevel=3)
        return None
    if group is not None:
        return group
    if GroupMember.WORLD is None:
        raise NotInitializedError(
            "anyccl.distributed: the default process group is not initialized: call "
            "init_process_group() first")
    return GroupMember.WORLD


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return GroupMember.WORLD is not None


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: timedelta | float | None = None, world_size: int = -1,
                       rank: int = -1, store: Any = None, group_name: str = "",
                       pg_options: Any = None, device_id: Any = None) -> None:
    """Create the default group, as torch.distributed.init_process_group does."""
    if GroupMember.WORLD is not None:
        raise RuntimeError("trying to initialize the default process group twice!")
    if store is not None:
        raise ValueError("anyccl.distributed.init_process_group does not take a torch store; "
                         "use init_method")
    GroupMember.WORLD = init(backend, rank=None if rank == -1 else rank,
                             world_size=None if world_size == -1 else world_size,
                             init_method=init_method, timeout=timeout)


def destroy_process_group(group: Communicator | None = None) -> None:
    if group is None or group is GroupMember.WORLD:
        if GroupMember.WORLD is not None:
            GroupMember.WORLD.close()
        GroupMember.WORLD = None
    elif group is not GroupMember.NON_GROUP_MEMBER:
        group.close()


def get_rank(group: Any = None) -> int:
    g = _group(group)
    return -1 if g is None else g.rank


def get_world_size(group: Any = None) -> int:
    g = _group(group)
    return -1 if g is None else g.size


def get_backend(group: Any = None) -> str:
    g = _group(group)
    return "" if g is None else g.backend


def new_group(ranks: Sequence[int] | None = None, timeout: Any = None, backend: Any = None,
              pg_options: Any = None) -> Any:
    world = _group(None)
    group = world.new_group(list(range(world.size)) if ranks is None else ranks)
    return GroupMember.NON_GROUP_MEMBER if group is None else group


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Work | None:
    g = _group(group)
    return None if g is None else g.barrier(async_op=async_op)


def send(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> None:
    g = _group(group)
    if g is not None:
        g.send(tensor, dst, tag)


def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Receive into `tensor` from `src` (None: from any rank); return the sender."""
    g = _group(group)
    return -1 if g is None else g.recv(tensor, src, tag)


def isend(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> Work | None:
    g = _group(group)
    return None if g is None else g.isend(tensor, dst, tag)


def irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0) -> Work | None:
    """Start receiving into `tensor` from `src` (None: any rank; the Work's `source` names the
    sender once complete)."""
    g = _group(group)
    return None if g is None else g.irecv(tensor, src, tag)


def broadcast(tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Work | None:
    g = _group(group)
    return None if g is None else g.broadcast(tensor, src, async_op=async_op)


def all_reduce(tensor: Any, op: ReduceOp = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Work | None:
    g = _group(group)
    return None if g is None else g.all_reduce(tensor, op, async_op=async_op)


def reduce(tensor: Any, dst: int, op: ReduceOp = ReduceOp.SUM, group: Any = None,
           async_op: bool = False) -> Work | None:
    g = _group(group)
    return None if g is None else g.reduce(tensor, dst, op, async_op=async_op)


def all_gather(tensor_list: list, tensor: Any, group: Any = None,
               async_op: bool = False) -> Work | None:
    g = _group(group)
    return None if g is None else g.all_gather(tensor_list, tensor, async_op=async_op)


def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None,
                           async_op: bool = False) -> Work | None:
    return all_gather(output_tensor, input_tensor, group, async_op)


def gather(tensor: Any, gather_list: list | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False) -> Work | None:
    g = _group(group)
    return None if g is None else g.gather(tensor, gather_list, dst, async_op=async_op)


def scatter(tensor: Any, scatter_list: list | None = None, src: int = 0, group: Any = None,
            async_op: bool = False) -> Work | None:
    g = _group(group)
    return None if g is None else g.scatter(tensor, scatter_list, src, async_op=async_op)


def all_gather_single(output_tensor: Any, input_tensor: Any, group: Any = None,
                      async_op: bool = False) -> Work | None:
    """torch 2.13's name for all_gather_into_tensor."""
    return all_gather(output_tensor, input_tensor, group, async_op)


def reduce_scatter(output: Any, input_list: list, op: ReduceOp = ReduceOp.SUM,
                   group: Any = None, async_op: bool = False) -> Work | None:
    g = _group(group)
    return None if g is None else g.reduce_scatter(output, input_list, op, async_op=async_op)


def reduce_scatter_tensor(output: Any, input: Any, op: ReduceOp = ReduceOp.SUM,  # noqa: A002
                          group: Any = None, async_op: bool = False) -> Work | None:
    return reduce_scatter(output, input, op, group, async_op)


def reduce_scatter_single(output: Any, input: Any, op: ReduceOp = ReduceOp.SUM,  # noqa: A002
                          group: Any = None, async_op: bool = False) -> Work | None:
    """torch 2.13's name for reduce_scatter_tensor."""
    return reduce_scatter(output, input, op, group, async_op)


def all_to_all(output_tensor_list: list, input_tensor_list: list, group: Any = None,
               async_op: bool = False) -> Work | None:
    g = _group(group)
    return None if g is None else g.all_to_all(output_tensor_list, input_tensor_list,
                                               async_op=async_op)


def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None,  # noqa: A002
                      input_split_sizes: Any = None, group: Any = None,
                      async_op: bool = False) -> Work | None:
    if not output_split_sizes and not input_split_sizes:
        return all_to_all(output, input, group, async_op)
    g = _group(group)
    if g is None:
        return None
    return g.all_to_all(output, input, async_op,
                        out_splits=split_elements(output.shape, output_split_sizes),
                        in_splits=split_elements(input.shape, input_split_sizes))


def broadcast_object_list(object_list: list, src: int = 0, group: Any = None,
                          device: Any = None) -> None:
    """Replace `object_list`'s items with those of rank `src` (pickle: trusted peers only)."""
    g = _group(group)
    if g is not None:
        object_list[:] = g.broadcast_object(list(object_list), src)


def all_gather_object(object_list: list, obj: Any, group: Any = None) -> None:
    """Fill `object_list` with every rank's `obj` (pickle: trusted peers only)."""
    g = _group(group)
    if g is not None:
        object_list[:] = g.all_gather_object(obj)


def gather_object(obj: Any, object_gather_list: list | None = None, dst: int = 0,
                  group: Any = None) -> None:
    """Rank `dst`'s `object_gather_list` (of the group's size) receives every rank's `obj` in
    rank order; other ranks pass None (pickle: trusted peers only)."""
    g = _group(group)
    if g is None:
        return
    if g.rank == dst and (object_gather_list is None or len(object_gather_list) != g.size):
        raise ValueError(f"rank {g.rank}: gather_object: object_gather_list must be a list of "
                         f"{g.size} entries on dst={dst}")
    everything = g.all_gather_object(obj)
    if g.rank == dst:
        object_gather_list[:] = everything  # type: ignore[index]


def scatter_object_list(scatter_object_output_list: list,
                        scatter_object_input_list: list | None = None, src: int = 0,
                        group: Any = None) -> None:
    """Rank i's `scatter_object_output_list[0]` becomes rank `src`'s
    `scatter_object_input_list[i]` (pickle: trusted peers only)."""
    g = _group(group)
    if g is None:
        return
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError(f"rank {g.rank}: scatter_object_list: scatter_object_output_list must "
                         f"be a non-empty list (its first entry receives the object)")
    if g.rank == src and (scatter_object_input_list is None
                          or len(scatter_object_input_list) != g.size):
        raise ValueError(f"rank {g.rank}: scatter_object_list: scatter_object_input_list must "
                         f"be a list of {g.size} objects on src={src}")
    everything = g.broadcast_object(scatter_object_input_list if g.rank == src else None, src)
    scatter_object_output_list[0] = everything[g.rank]


def send_object_list(object_list: list, dst: int, group: Any = None, device: Any = None) -> None:
    """Send the objects of `object_list` to rank `dst` (pickle: trusted peers only)."""
    import numpy as np

    g = _group(group)
    if g is None:
        return
    payload = np.frombuffer(pickle.dumps(list(object_list)), np.uint8)
    g.send(np.array([payload.size], np.int64), dst)
    g.send(payload.copy(), dst)


def recv_object_list(object_list: list, src: int | None = None, group: Any = None,
                     device: Any = None) -> int:
    """Fill `object_list` with the objects rank `src` (None: any rank) sent with
    send_object_list (as many as it has entries) and return the sender."""
    import numpy as np

    g = _group(group)
    if g is None:
        return -1
    length = np.zeros(1, np.int64)
    src = g.recv(length, src)   # then the payload from the same rank, which sent it next
    payload = np.empty(int(length[0]), np.uint8)
    g.recv(payload, src)
    got = pickle.loads(payload.tobytes())
    object_list[:len(got)] = got[:len(object_list)]
    return src


class P2POp:
    """One message of `batch_isend_irecv`: `op` is `isend` or `irecv` (these functions)."""

    def __init__(self, op: Any, tensor: Any, peer: int, group: Any = None, tag: int = 0) -> None:
        if op not in (isend, irecv):
            raise ValueError(f"P2POp: op must be anyccl.distributed.isend or irecv, not {op!r}")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Issue the messages together (as one NCCL group on GPUs, so rings cannot deadlock) and
    return their Works."""
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv: p2p_op_list is empty")
    groups = {id(p.group) for p in p2p_op_list}
    if len(groups) > 1:
        raise ValueError("batch_isend_irecv: every P2POp must name the same group")
    g = _group(p2p_op_list[0].group)
    if g is None:
        return []
    works: list[Work] = []
    with g.batch():
        for p in p2p_op_list:
            issue = g.isend if p.op is isend else g.irecv
            works.append(issue(p.tensor, p.peer, p.tag))
    return works


def monitored_barrier(group: Any = None, timeout: timedelta | float | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that raises anyccl.TimeoutError on this rank if the others have not all
    arrived within `timeout` (default: the communicator's own deadline, whose error names the
    ranks that did not arrive)."""
    g = _group(group)
    if g is None:
        return
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    work = g.barrier(async_op=True)
    assert work is not None
    work.wait(seconds)
