"""Sub-communicators: `split` (by color and key, as MPI_Comm_split) and `new_group` (a list of
ranks, as torch.distributed.new_group), both collective over the parent communicator. The
members agree through one object all-gather; each member's host backend and, where it exists,
GPU backend are split alongside, so the child serves host and GPU arrays as the parent does.
Called by `Communicator.split` and `Communicator.new_group` once the communicator is open."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backends.base import Backend
    from .backends.gpu_base import GpuBackend
    from .communicator import Communicator


def split(comm: Communicator, color: int | None, key: int | None) -> Communicator | None:
    """A new communicator of the ranks of `comm` that pass the same `color`, ordered by (`key`,
    rank); None where color is None."""
    check = comm._check
    if color is not None and (isinstance(color, bool) or not isinstance(color, int)
                              or color < 0):
        raise check.fail("split", f"color={color!r} must be a non-negative int or None")
    if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
        raise check.fail("split", f"key={key!r} must be an int or None")
    choices = comm.all_gather_object((color, comm.rank if key is None else key))
    comm._splits += 1
    name = f"{comm._name}.{comm._splits}.{color}"
    ranks = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(choices) if c == color)]
    # an existing GPU communicator splits too (collective over all of its ranks)
    gpu_child = comm._gpu_side.split(
        color, choices[comm.rank][1],
        f"rank {ranks.index(comm.rank)} ({name})" if color is not None else "",
        store=comm._store, group=name)
    if color is None:
        return None
    return child_of(comm, comm._engine.subgroup(ranks, name), ranks, name,
                    f"split from {comm._name} ({comm.backend_reason})",
                    local_rank=comm.local_rank, gpu_backend=gpu_child)


def child_of(comm: Communicator, backend: Backend, ranks: list[int], name: str, reason: str,
             *, local_rank: int, gpu_backend: GpuBackend | None = None) -> Communicator:
    """The communicator `name` of `ranks` of `comm` (this rank among them) on host backend
    `backend` (and `gpu_backend`, else one made on its first GPU call): what split and
    shrink (recovery.py) make. `backend` is closed if the communicator cannot be made."""
    try:
        child = type(comm)(backend, comm._store, rank=ranks.index(comm.rank), size=len(ranks),
                           local_rank=local_rank, timeout_s=comm.timeout_s, name=name,
                           job_id=comm.job_id, debug=comm.debug, device=comm._gpu_side.device,
                           gpu_backend=gpu_backend, gpu_kind=comm._gpu_side.kind)
    except BaseException:
        backend.close()
        raise
    if comm.hosts:
        child.hosts = tuple(comm.hosts[r] for r in ranks)
    child.backend_reason = reason
    return child


def new_group(comm: Communicator, ranks: Sequence[int]) -> Communicator | None:
    """A communicator of `ranks` of `comm` (in ascending order, as torch.distributed orders
    them); None on the ranks not listed."""
    members = list(ranks)
    for r in members:
        comm._check.peer("new_group", r, "ranks[...]")
    if not members or len(set(members)) != len(members):
        raise comm._check.fail("new_group", f"ranks={members} must be a non-empty list of "
                               f"distinct ranks")
    ordered = sorted(members)
    inside = comm.rank in ordered
    return split(comm, 0 if inside else None, ordered.index(comm.rank) if inside else None)
