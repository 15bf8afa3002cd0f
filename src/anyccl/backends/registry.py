"""The one table of backends: what `anyccl.init()`, `anyccl info` and `anyccl bench` know.

A backend is a module (or a package) implementing `base.Backend` (host arrays) or
`gpu_base.GpuBackend` (GPU arrays), plus one registration: `register_host(...)` or
`register_gpu(...)`, with the function that creates it for a communicator and the function
that says whether it is usable on this machine. anyccl's own are registered in `builtin.py`;
a program (or a test) can register its own the same way before calling `anyccl.init()`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..errors import UnsupportedError

if TYPE_CHECKING:
    from ..store import Store
    from .base import Backend
    from .gpu_base import GpuBackend


@dataclass(frozen=True)
class HostContext:
    """What a host backend is created from: collective over the `size` ranks of the job."""

    store: Store
    rank: int
    size: int
    job_id: str
    timeout_s: float
    hosts: tuple[str, ...] = ()       # the host name of every rank (when known)
    addresses: tuple[str, ...] = ()   # the address other hosts reach every rank's host at
    comm_name: str = "world"          # the communicator's name (another: grown from one)


@dataclass(frozen=True)
class GpuContext:
    """What a GPU backend is created from: collective over the communicator's ranks.

    `key` is where in `store` this communicator's GPU backend may publish what it must share;
    `host` is the communicator's host backend (whose `lost_peer` says when a peer died);
    `meet()` is a barrier over the host backend, with its deadline: call it before a transport
    rendezvous that has none of its own (NCCL's), so a rank that never comes is a timeout, not
    a hang."""

    store: Store
    key: str
    rank: int
    size: int
    device: int
    label: str
    timeout_s: float
    host: Backend
    meet: Callable[[], None]


@dataclass(frozen=True)
class HostEntry:
    name: str
    serves: str                                  # what `anyccl info` says it serves
    create: Callable[[HostContext], Backend]
    status: Callable[[], str]                    # "available (...)" or "not usable: ..."
    gpu_arrays: str = "nccl"                     # the GPU backend for GPU arrays by default


@dataclass(frozen=True)
class GpuEntry:
    name: str
    serves: str
    create: Callable[[GpuContext], GpuBackend]
    status: Callable[[], str]
    selectable: bool = True                      # may be named in backend="..."


_HOST: dict[str, HostEntry] = {}
_GPU: dict[str, GpuEntry] = {}
ALIASES = {"gloo": "shm", "cpu": "shm"}          # torch.distributed scripts name gloo
_loaded = False
_LOADING = threading.Lock()


def register_host(entry: HostEntry) -> None:
    """Make a host backend known by `entry.name` (replacing one of that name)."""
    _HOST[entry.name] = entry


def register_gpu(entry: GpuEntry) -> None:
    """Make a GPU backend known by `entry.name` (replacing one of that name)."""
    _GPU[entry.name] = entry


def _builtin() -> None:
    global _loaded
    if _loaded:
        return
    with _LOADING:  # two threads calling init() at once both see the whole registry
        if not _loaded:
            from . import builtin  # noqa: F401 - registers anyccl's own backends
            _loaded = True


def host_backends() -> dict[str, HostEntry]:
    _builtin()
    return dict(_HOST)


def gpu_backends() -> dict[str, GpuEntry]:
    _builtin()
    return dict(_GPU)


def host_entry(name: str) -> HostEntry:
    """The host backend called `name` (or an alias of it); UnsupportedError naming the known
    ones otherwise."""
    found = host_backends().get(ALIASES.get(name, name))
    if found is None:
        known = ", ".join([*host_backends(), *selectable_gpu_backends()])
        raise UnsupportedError(f"backend={name!r} is unknown; available: {known}")
    return found


def gpu_entry(name: str) -> GpuEntry:
    found = gpu_backends().get(name)
    if found is None:
        raise UnsupportedError(f"GPU backend {name!r} is unknown; available: "
                               f"{', '.join(selectable_gpu_backends())}")
    return found


def selectable_gpu_backends() -> list[str]:
    return [name for name, entry in gpu_backends().items() if entry.selectable]
