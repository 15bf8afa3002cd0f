"""`anyccl.init()`: find this process's rank and peers, meet them, and build a Communicator.

Explicit arguments win; then the environment of `anyccl run`, torchrun (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), mpiexec (OMPI_COMM_WORLD_*, PMI_*) and SLURM; a plain
`python script.py` is a world of one.
"""

from __future__ import annotations

import atexit
import importlib.util
import ipaddress
import logging
import os
import secrets
import socket
import time
import warnings
from builtins import TimeoutError as BuiltinTimeoutError
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from . import settings
from .arguments import seconds
from .backends import registry
from .communicator import Communicator
from .errors import (
    AnycclError,
    InvalidArgumentError,
    RendezvousError,
    TimeoutError,
    UnsupportedError,
)
from .lifetime import close_all
from .store import FileStore, PrefixStore, Store, StoreServer, TCPStore

log = logging.getLogger("anyccl")

# (rank, world size, local rank) variables of the launchers we recognise, in order of preference
_LAUNCHER_ENV = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)

_servers: list[StoreServer] = []  # stores this process hosts; they live until it exits
_generation = 0  # how many times this process called init(): every rank counts alike


def _launched_by_mpiexec() -> bool:
    return bool(_env_int("OMPI_COMM_WORLD_SIZE") or _env_int("PMI_SIZE"))


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise RendezvousError(f"environment variable {name}={text!r} is not an integer") from None


def _launcher_identity() -> tuple[int | None, int | None, int | None]:
    for rank_var, size_var, local_var in _LAUNCHER_ENV:
        rank, size = _env_int(rank_var), _env_int(size_var)
        if rank is not None and size is not None:
            return rank, size, _env_int(local_var)
    return None, None, None


def _job_key() -> bytes | None:
    text = settings.JOB_KEY.get()
    if not text:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {settings.JOB_KEY.name} is not valid; "
                                   f"expected hexadecimal digits (e.g. from `python -c 'import "
                                   f"secrets; print(secrets.token_hex(32))'`)") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _serve(key: bytes, host: str, port: int, timeout_s: float) -> tuple[str, int]:
    """Rank 0 serves the job's store on `host`:`port` (0: a free one): from a thread of this
    process, or, when the job goes on after a rank dies (ANYCCL_KEEP_GOING), from a process of
    its own that outlives this one (store_process.py). Where it listens."""
    if settings.KEEP_GOING.get():
        from . import store_process

        return store_process.start(key, host, port, timeout_s)[:2]
    server = StoreServer(key, host=host, port=port)
    _servers.append(server)
    return server.host, server.port


def _tcp_store(host: str, port: int, rank: int, timeout_s: float) -> Store:
    key = _job_key()
    if key is None:
        # Without a secret every rank can compute, the store's HMAC proves nothing: anyone who
        # reaches the port could join. On loopback that is only this machine's users.
        if not _is_loopback(host):
            allow = settings.ALLOW_UNAUTHENTICATED_STORE
            if not allow.get():
                raise RendezvousError(
                    f"rank {rank}: the rendezvous at {host}:{port} is reachable from the network "
                    f"and no job key is set, so anyone who reaches the port could join the job "
                    f"and send its ranks data; set {settings.JOB_KEY.name} to the same secret "
                    f"on every rank (e.g. `export {settings.JOB_KEY.name}=$(python -c 'import "
                    f"secrets; print(secrets.token_hex(32))')` before launching), or set "
                    f"{allow.name}=1 to accept the risk")
            warnings.warn(f"anyccl: the rendezvous at {host}:{port} is not authenticated "
                          f"({allow.name}=1): anyone who reaches the port can join this job",
                          RuntimeWarning, stacklevel=3)
            key = f"anyccl-unkeyed:{port}".encode()
        else:
            return _loopback_store(host, port, rank, timeout_s)
    if rank == 0:
        _serve(key, "127.0.0.1" if _is_loopback(host) else host, port, timeout_s)
    return TCPStore(host, port, key, timeout_s)


def _loopback_store(host: str, port: int, rank: int, timeout_s: float) -> Store:
    """An unkeyed rendezvous on this machine (env:// or tcp:// on loopback, no job key): rank
    0 makes a random key and leaves it in a 0600 file of this user's private directory
    (private.py), where this user's other ranks read it and no other local user can; the
    store's handshake then admits the job's ranks alone. A key file left by an earlier job on
    the same port may be read before rank 0 replaces it: a refused rank reads it again."""
    from . import private

    path = os.path.join(private.user_directory(), f"store-{host}-{port}.key")
    if rank == 0:
        key = secrets.token_bytes(32)
        private.write(path, key)
        atexit.register(_remove_quietly, path, os.getpid())
        _serve(key, "127.0.0.1", port, timeout_s)
        return TCPStore(host, port, key, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            key = private.read(path)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"rank {rank}: rank 0 did not leave the rendezvous key of {host}:{port} in "
                    f"{path} within {timeout_s:g} s; ranks of one unkeyed job must run as one "
                    f"user on one machine (or set {settings.JOB_KEY.name} on every rank)") \
                    from None
            time.sleep(0.01)
            continue
        except OSError as exc:
            raise RendezvousError(f"rank {rank}: cannot read the rendezvous key {path}: {exc}") \
                from None
        try:
            return TCPStore(host, port, key, max(0.1, deadline - time.monotonic()))
        except RendezvousError:
            try:
                newer = private.read(path)
            except OSError:
                newer = key
            if newer == key or time.monotonic() >= deadline:
                raise


def _remove_quietly(path: str, owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a child forked after init(): the file is its parent's
        return
    try:
        os.unlink(path)
    except OSError:
        pass


def _torch_agent_store(timeout_s: float) -> Store:
    """torchrun's agent already serves a store at MASTER_PORT; talk to it with torch."""
    import torch.distributed as tdist

    return C10dStore(tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    is_master=False, timeout=timedelta(seconds=timeout_s)))


class C10dStore(Store):
    """A torch.distributed (c10d) store seen as anyccl's: torchrun's agent store, or the store
    torch hands a process group. anyccl's keys live under "anyccl/"."""

    def __init__(self, inner: object) -> None:
        self._inner: Any = inner

    def set(self, key: str, value: bytes) -> None:
        self._inner.set("anyccl/" + key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        self._inner.wait(["anyccl/" + key], timedelta(seconds=timeout_s))
        return self._inner.get("anyccl/" + key)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add("anyccl/" + key, amount)

    def check(self, key: str) -> bool:
        return self._inner.check(["anyccl/" + key])

    def delete(self, key: str) -> None:
        self._inner.delete_key("anyccl/" + key)


def _mpi_store(rank: int, timeout_s: float) -> Store:
    """Under mpiexec: rank 0 serves the store and broadcasts its address and a fresh job key
    over MPI (the key never leaves the job's own MPI messages). On loopback when every rank
    runs on rank 0's host; else on the address other hosts reach (netaddr.py)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise RendezvousError(
            "launched by mpiexec, but mpi4py is not installed to exchange the rendezvous address;"
            " pip install mpi4py, or set MASTER_ADDR and MASTER_PORT") from None
    from .netaddr import reachable_address

    world = MPI.COMM_WORLD
    hosts = world.allgather(socket.gethostname())
    offer: tuple | str | None = None
    if rank == 0:
        key = secrets.token_bytes(32)
        try:
            bind = "127.0.0.1" if len(set(hosts)) == 1 else reachable_address()
            offer = (*_serve(key, bind, 0, timeout_s), key)
        except (AnycclError, OSError) as exc:
            offer = f"rank 0 on {hosts[0]} cannot serve the rendezvous: {exc}"
    offer = world.bcast(offer, root=0)
    if isinstance(offer, str):
        raise RendezvousError(f"rank {rank}: {offer}")
    host, port, key = offer
    try:
        return TCPStore(host, port, key, min(timeout_s, 30.0))
    except RendezvousError as exc:
        raise RendezvousError(
            f"rank {rank} on {hosts[rank]}: cannot reach the rendezvous store that rank 0 serves "
            f"at {host}:{port} on {hosts[0]} ({exc.__cause__ or exc}); if that address is not "
            f"the network the hosts share, set {settings.SOCKET_IFNAME.name} to the interface "
            f"that is (on every host)") from None


def _first_node(nodelist: str) -> str:
    """The first host of a SLURM node list: "node[07-09,12],gpu3" -> "node07"."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    if "[" not in first:
        return first
    prefix, _, rest = first.partition("[")
    return prefix + rest.rstrip("]").split(",")[0].split("-")[0]


def _slurm_store(rank: int, timeout_s: float) -> Store | None:
    """Under srun without MASTER_ADDR (as Lightning does): rank 0 on the first node of
    SLURM_JOB_NODELIST serves the store, at MASTER_PORT or 15000 + the job id's last four
    digits. Keyed by ANYCCL_JOB_KEY (a key derived from the port would prove nothing)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist or _env_int("SLURM_PROCID") is None:
        return None
    host = _first_node(nodelist)
    port = _env_int("MASTER_PORT")
    if port is None:
        job = os.environ.get("SLURM_JOB_ID", "")
        port = 15000 + int(job[-4:]) if job[-4:].isdigit() else 29500
    return _tcp_store(host, port, rank, timeout_s)


def _make_store(init_method: str | None, rank: int, size: int, timeout_s: float) -> Store:
    if init_method is not None:
        url = urlparse(init_method)
        if url.scheme == "env":
            return _make_store(None, rank, size, timeout_s)
        elif url.scheme == "tcp":
            if not url.hostname or not url.port:
                raise InvalidArgumentError(
                    f"init_method={init_method!r}: expected tcp://host:port")
            return _tcp_store(url.hostname, url.port, rank, timeout_s)
        elif url.scheme == "file":
            return FileStore(url.path, size)
        else:
            raise InvalidArgumentError(f"init_method={init_method!r}: expected env://, "
                                       f"tcp://host:port or file:///path")
    address = settings.STORE.get()
    if address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgumentError(f"environment variable {settings.STORE.name}={address!r} "
                                       f"is not valid; expected host:port")
        return TCPStore(host, int(port), _job_key() or b"", timeout_s)
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return _torch_agent_store(timeout_s)
        return _tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank,
                          timeout_s)
    if size == 1:
        key = secrets.token_bytes(32)
        server = StoreServer(key)
        _servers.append(server)
        return TCPStore(server.host, server.port, key, timeout_s)
    if _env_int("OMPI_COMM_WORLD_SIZE") or _env_int("PMI_SIZE"):
        return _mpi_store(rank, timeout_s)
    slurm = _slurm_store(rank, timeout_s)
    if slurm is not None:
        return slurm
    raise RendezvousError(
        f"rank {rank} of {size} has no way to meet its peers: launch with `anyccl run -n "
        f"{size}`, torchrun or mpiexec, or pass init_method='tcp://host:port' or 'file:///path'")


def newcomer_store(init_method: str | None, timeout_s: float) -> Store:
    """The connection to a running job's store for a process started after it (grow.py), as
    a client: from `init_method` or the environment its launcher gave it (ANYCCL_STORE and
    the job key, MASTER_ADDR and MASTER_PORT). A newcomer never serves the store (rank -1)."""
    if init_method is not None and urlparse(init_method).scheme == "file":
        raise InvalidArgumentError(f"init_method={init_method!r}: a newcomer meets the job "
                                   f"through its TCP store (tcp://host:port or env://)")
    if init_method is None and not settings.STORE.get() and not (
            os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise RendezvousError(
            f"join: this process has no way to find its job's store: start it with the "
            f"environment of the job's ranks ({settings.STORE.name} and "
            f"{settings.JOB_KEY.name}, as `anyccl run` sets them, or MASTER_ADDR and "
            f"MASTER_PORT), or pass init_method='tcp://host:port'")
    return _make_store(init_method, -1, 0, timeout_s)


def _hosts(store: Store, rank: int, size: int,
           timeout_s: float) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(host name, address other hosts reach it at) of every rank, as each rank published it
    (the address only where this machine has one besides loopback)."""
    from .netaddr import reachable_address

    if size == 1:
        return (socket.gethostname(),), ("",)
    try:
        address = reachable_address()
    except AnycclError:
        address = ""
    store.set(f"host/{rank}", f"{socket.gethostname()}\n{address}".encode())
    deadline = time.monotonic() + timeout_s
    try:   # rank 0 reads every rank's entry and publishes the map: O(n) requests at the store
        if rank == 0:
            entries = [store.get(f"host/{r}", max(0.0, deadline - time.monotonic())).decode()
                       for r in range(size)]
            store.set("hosts", "\0".join(entries).encode())
        else:
            entries = store.get("hosts", max(0.0, deadline - time.monotonic())).decode() \
                .split("\0")
    except BuiltinTimeoutError:
        missing = [m for m in range(size) if not store.check(f"host/{m}")]
        who = (f"rank{'s' if len(missing) > 1 else ''} {_ranges(missing)} never arrived (a node "
               f"or launcher that did not start, or a world size that differs between ranks)"
               if missing else "every rank arrived, but rank 0 did not publish the host map "
               "(it stopped or lost the store)")
        raise TimeoutError(f"rank {rank}: the rendezvous of {size} ranks did not complete within "
                           f"{timeout_s:g} s: {who}") from None
    if len(entries) != size:
        raise AnycclError(f"rank {rank}: rank 0 published the hosts of {len(entries)} ranks, "
                          f"this rank was started for {size}: the world size differs between "
                          f"ranks")
    said = [entry.partition("\n") for entry in entries]
    return tuple(name for name, _, _ in said), tuple(address for _, _, address in said)


def _ranges(ranks: list[int]) -> str:
    """[2, 3, 4, 7] -> '2-4, 7'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def _across_hosts(name: str, named: bool, hosts: tuple[str, ...],
                  addresses: tuple[str, ...]) -> tuple[str, str]:
    """(host backend, why) for ranks on more than one host: `name` as chosen so far, `named`
    whether the program or ANYCCL_BACKEND named it."""
    count = len(set(hosts))
    if name == "mpi" and named:
        return name, f"named; ranks on {count} hosts, one MPI communicator over all"
    if name not in ("shm", "mpi"):
        return name, "named"
    if _launched_by_mpiexec() and _has_mpi4py():
        # measured on 2-4 simulated hosts (16 cores): MPI ahead of gloo at 1-16 MiB; gloo ahead
        # at 64-256 MiB, by 6-12% from 3 hosts at 2 Gbit/s, up to 73% on 2 at 10 Gbit/s
        return "shm+mpi", (f"ranks on {count} hosts under mpiexec: shared memory inside each "
                           f"host, MPI between hosts (measured ahead of torch's gloo up to 16 "
                           f"MiB; for all_reduces of 64 MiB and more backend='shm+gloo' "
                           f"measured faster: see 'Many machines' in the docs)")
    if importlib.util.find_spec("torch") is not None:
        missing = [r for r, a in enumerate(addresses) if not a]
        if missing:
            raise RendezvousError(
                f"ranks span {count} hosts, but rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} found no network address other hosts can "
                f"reach; set {settings.SOCKET_IFNAME.name} to the interface the hosts share")
        return "shm+gloo", (f"ranks on {count} hosts: shared memory inside each host, torch's "
                            f"gloo between hosts")
    raise UnsupportedError(
        f"the ranks span {count} hosts ({', '.join(sorted(set(hosts)))}); anyccl moves data "
        f"between hosts with MPI (launch with mpiexec and pip install mpi4py) or with torch's "
        f"gloo (pip install torch), and neither is available here")


def parse_backend(backend: str | None) -> tuple[str, str | None]:
    """(host backend, GPU backend named up front or None) from "shm", "nccl", "gloo",
    "cpu:shm,cuda:nccl" or ANYCCL_BACKEND, by the names registered (backends/registry.py).
    Naming a GPU backend creates it at init(); otherwise the first collective on GPU arrays
    creates the host backend's default one."""
    spec = (backend or settings.BACKEND.get() or "shm").strip().lower()
    gpu_names = registry.selectable_gpu_backends()
    host, device_backend = None, None
    for part in spec.split(","):
        kind, _, name = part.strip().rpartition(":")
        if kind not in ("", "cpu", "cuda"):
            raise UnsupportedError(f"backend={spec!r}: device {kind!r} is unknown; write e.g. "
                                   f"'cpu:shm,cuda:nccl'")
        if name in gpu_names and kind != "cpu":
            device_backend = name
        elif kind == "cuda":
            raise UnsupportedError(f"backend={spec!r}: {name!r} is not a GPU backend; GPU "
                                   f"backends: {', '.join(gpu_names)}")
        else:
            host = registry.host_entry(name).name
    return host or "shm", device_backend


def _one_host_default() -> str:
    """Why an unnamed backend on one host is shm, also under mpiexec (mpi when named)."""
    if _launched_by_mpiexec():
        return ("default on one host, also under mpiexec: shared memory is faster than MPI "
                "inside a host; ranks keep MPI's numbering, and backend='mpi' (or "
                "ANYCCL_BACKEND=mpi) runs on MPI")
    return "default on one host"


def _has_mpi4py() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def _device_index(device_id: object) -> int:
    index = getattr(device_id, "index", device_id)  # torch.device("cuda:1") -> 1
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise InvalidArgumentError(f"device_id={device_id!r} must be a CUDA device index (an int "
                                   f"or torch.device('cuda:N'))")
    return index


def init(backend: str | None = None, *, rank: int | None = None,
         world_size: int | None = None, init_method: str | None = None,
         timeout: float | timedelta | None = None,
         local_rank: int | None = None, debug: bool | None = None,
         device_id: object = None) -> Communicator:
    """Join the job and return the communicator of all its ranks.

    Args:
        backend: "shm" (the default on one host; "gloo" is accepted as its alias) for host
            arrays; "nccl" or "cpu:shm,cuda:nccl" also creates the NCCL communicator for GPU
            arrays now (otherwise the first collective on GPU arrays creates it); "ipc" runs
            GPU arrays on anyccl's own peer-memory kernels where they apply (NCCL for the
            rest), "auto" only where they were measured faster. Default: ANYCCL_BACKEND, else
            mpi under mpiexec (with mpi4py), else shm; ranks on several hosts get shm inside
            each host and MPI or torch's gloo between hosts.
        rank: this process's rank. Default: from the launcher's environment (anyccl run,
            torchrun, mpiexec, SLURM), else 0 in a world of one.
        world_size: the number of ranks. Default: as `rank`.
        init_method: "env://" (MASTER_ADDR and MASTER_PORT), "tcp://host:port" (rank 0 serves
            it) or "file:///path" (a directory every rank sees). Default: from the
            environment.
        timeout: seconds (or a timedelta) any one operation may wait before it fails with
            anyccl.TimeoutError. Default: ANYCCL_TIMEOUT, else 600.
        local_rank: this process's rank among the ranks of its host. Default: from the
            launcher's environment, else counted from the hosts the ranks report.
        debug: check before every collective that all ranks called the same one with agreeing
            arguments (CollectiveMismatchError otherwise). Default: ANYCCL_DEBUG.
        device_id: this rank's CUDA device (int or torch.device). Default: local_rank modulo
            the number of visible devices. Giving it creates the NCCL communicator now, as
            torch does.

    In a process started in place of a lost rank (ANYCCL_NEWCOMER=1, as `anyccl run
    --replace` starts them) it is `anyccl.join()`: it waits until the job's ranks grow their
    communicator (`comm.grow()`) and returns the grown one, on their backend.

    Returns:
        The communicator of all ranks of the job.

    Raises:
        InvalidArgumentError: a rank, world size or device that cannot be.
        UnsupportedError: a backend that is unknown, or that nothing on this machine can run.
        RendezvousError: the ranks could not find each other.
        TimeoutError: a rank did not arrive within `timeout`.

    Example:
        ```python
        comm = anyccl.init()                  # from anyccl run, torchrun, mpiexec or SLURM
        comm = anyccl.init("nccl", timeout=60)
        ```
    """
    if settings.NEWCOMER.get():   # started in place of a lost rank (`anyccl run --replace`)
        from .grow import join

        return join(timeout, init_method=init_method, device_id=device_id)
    if debug is None:
        debug = settings.DEBUG.get()
    env_rank, env_size, _ = _launcher_identity()
    rank = env_rank if rank is None else rank
    world_size = env_size if world_size is None else world_size
    if rank is None and world_size is None:
        rank, world_size = 0, 1
    if rank is None or world_size is None:
        raise InvalidArgumentError(f"pass both rank and world_size (got rank={rank}, "
                                   f"world_size={world_size})")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{name}={value!r} must be an int")
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank={rank} must be in 0..world_size-1 and world_size="
                                   f"{world_size} at least 1")
    timeout_s = seconds(timeout, settings.TIMEOUT.get())
    parse_backend(backend)  # refused by name before any store starts
    if device_id is not None:
        _device_index(device_id)
    connection = _make_store(init_method, rank, world_size, timeout_s)
    return connect(connection, rank, world_size, backend=backend, timeout_s=timeout_s,
                   local_rank=local_rank, debug=debug, device_id=device_id, owns_store=True)


def new_job_id(token: str) -> str:
    """A job id: `token` (hexadecimal, unique to the job) after ANYCCL_JOB_PREFIX, if set."""
    prefix = settings.JOB_PREFIX.get() or ""
    if prefix and (not prefix.isascii() or not prefix.isalnum() or len(prefix) > 24):
        settings.JOB_PREFIX._refuse(prefix, "at most 24 letters and digits")
    return prefix + token


def connect(connection: Store, rank: int, world_size: int, *, backend: str | None,
            timeout_s: float, local_rank: int | None, debug: bool, device_id: object = None,
            owns_store: bool = False, meeting: str | None = None, job_id: str | None = None,
            comm_name: str = "world") -> Communicator:
    """The communicator of `world_size` ranks that meet through `connection` (an open store:
    init()'s own, or one torch.distributed hands a process group); `owns_store`: close it with
    the communicator. Ranks already checked. `meeting`: the key space of `connection` they
    meet in (default: a fresh one per init() of this process), `job_id` and `comm_name`
    those of a communicator grown from another (grow.py)."""
    name, gpu_name = parse_backend(backend)
    device = None if device_id is None else _device_index(device_id)
    env_local = _launcher_identity()[2]
    if meeting is None:
        global _generation
        _generation += 1
        # a fresh key space per init(), so a job may close its communicator and init again
        meeting = f"init{_generation}"
    store = PrefixStore(meeting, connection)
    try:
        job_id = job_id or settings.JOB_ID.get()
        if not job_id:
            if rank == 0:
                store.set("job_id", new_job_id(secrets.token_hex(4)).encode())
            job_id = store.get("job_id", timeout_s).decode()
        hosts, addresses = _hosts(store, rank, world_size, timeout_s)
        if local_rank is None:
            local_rank = env_local if env_local is not None else \
                hosts[:rank].count(hosts[rank])
        why = "named" if (backend or settings.BACKEND.get()) else _one_host_default()
        if len(set(hosts)) > 1:
            name, why = _across_hosts(name, bool(backend or settings.BACKEND.get()), hosts,
                                      addresses)
        log.info("anyccl: rank %d: host backend %s (%s)", rank, name, why)
        backend_impl = registry.host_entry(name).create(
            registry.HostContext(store, rank, world_size, job_id, timeout_s, hosts, addresses,
                                 comm_name))
    except BaseException:
        if owns_store:
            connection.close()
        raise
    _dump_flight_records_on_sigterm()
    comm = Communicator(backend_impl, store, rank=rank, size=world_size, local_rank=local_rank,
                        timeout_s=timeout_s, name=comm_name, job_id=job_id, debug=debug,
                        owns_store=owns_store, device=device, gpu_kind=gpu_name)
    comm.backend_reason = why
    comm.hosts = hosts
    if gpu_name is not None or device is not None:
        try:
            comm.connect_gpu()
        except BaseException:
            comm.close()
            raise
    return comm


def _dump_flight_records_on_sigterm() -> None:
    """When `anyccl run` stops this rank (SIGTERM), first write where every communicator was,
    so the launcher can say which rank was behind. Only if the program set no handler."""
    import signal
    import threading

    if not settings.LAUNCHER_PID.is_set() or \
            threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, _frame: object) -> None:
        from .lifetime import live
        from .trace import flight_directory

        for comm in list(live):
            try:
                comm.flight_recorder.dump(flight_directory(comm.job_id))
            except OSError:
                pass
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)


atexit.register(close_all)
