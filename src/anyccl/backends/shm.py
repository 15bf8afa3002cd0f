"""`shm`: ranks on one machine move data through shared-memory segments. The embedded default.

Each rank creates one POSIX shared-memory segment (mode 0600) and maps every peer's:

    control   counters this rank alone writes (barrier arrivals, bytes sent and consumed per
              channel, messages read directly per sender), its pid, a closed flag, what it is
              doing now, and its doorbell
    channels  one byte ring per destination for point-to-point messages (a large message
              sends only its header there: the receiver reads the data directly out of the
              sender's memory, then counts the read)
    staging   two halves that the collective schedules of `algorithms.symmetric` write and
              peers read

Every counter has exactly one writer, so plain aligned 8-byte stores suffice on x86-64 (TSO);
data is always written before the counter that publishes it. A rank that changes something a
peer may wait for rings the peer's doorbell; waiters spin briefly, then sleep in the kernel.

Safety: the first barrier of every collective carries its signature (op, dtype, count, root,
reduce op), and every rank compares all of them before any rank reads or writes a peer's
memory, so ranks that disagree all raise `CollectiveMismatchError` with their arrays untouched.
Direct process-to-process copies are bounded, besides, by the address and length the peer
published for the operation; a direct message is only ever read, into the receiver's own
memory. A peer's segment is mapped only if this user owns it with mode
0600, and a copy that fails because the peer died is a `PeerLostError` naming it.

Once every rank has mapped every segment, the names are unlinked: the memory lives exactly as
long as the mappings, so nothing is left in /dev/shm even if every rank is killed. (Between
creation and unlinking, a crash can leave a segment named ``anyccl-<job>-...``; `anyccl run`
removes those of its job when it ends.)
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import socket
import struct
import time
from collections import deque
from typing import Any, Callable

import numpy as np

from .. import agreement, settings, tuning
from ..algorithms import direct, symmetric
from ..buffers import SUPPORTED_DTYPES
from ..errors import (
    CommunicatorClosedError,
    InvalidArgumentError,
    PeerLostError,
    RendezvousError,
    TimeoutError,
    UnsupportedError,
)
from ..liveness import process_alive
from ..ops import COLLECTIVES, ReduceOp, check_reduce_op
from ..store import Store
from ..trace import OpRecord, about_text, format_bytes, message_text
from . import cross_memory
from .base import Backend, Completion
from .doorbell import Doorbell, cores_available
from .registry import HostContext

try:  # the per-call core in C (_shmcore.c); without it, the same steps in Python and NumPy
    from . import _shmcore
except ImportError:  # pragma: no cover - built without a C compiler
    _shmcore = None

try:  # the same calls multiprocessing.shared_memory uses, without its resource tracker
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX platforms
    _posixshmem = None

_MAGIC = 0x616E7963636C3031        # "anyccl01"

# control block, in 8-byte words
_W_MAGIC, _W_PID, _W_ARRIVE, _W_CLOSED, _W_STATUS_LEN = 0, 1, 2, 3, 8
_BELL_OFFSET = 32                  # bytes; SEM_BYTES long, words 4..7
_STATUS_OFFSET, _STATUS_BYTES = 72, 256
_REFUSAL_BYTES = 512
_W_SEGMENT_ADDRESS = 42            # where the owner maps its own segment (to probe CMA)
_W_LOST = 43                       # 1 + the rank whose loss this rank reported (0: none)
_W_DOING = 44                      # what this rank does: seq << 24 | name code << 1 | 1 if in it
_W_STATUS_FOR = 45                 # the _W_DOING value the status text describes
_W_AGREE = 46                      # words 46..49: the current collective's signature, in the
                                   # slot of its first barrier's parity (agreement.py)
_W_SENT = 64                       # words 64 .. 64+n: bytes this rank wrote into channel to j
_HEADER = 32                       # message header: tag, nbytes, dtype code, and 0, or for a
                                   # message read directly, its address in the sender (int64 each)
_HEADER_WORDS = struct.Struct("<4q")
_PEER_CHECK_S = 0.25
_DEADLINE_CHECK_S = 0.001  # how often progress() looks for posted messages past their deadline
# how long a direct message no receive has claimed stays in its sender's memory before it is
# read into a buffer (so that its send completes also when no receive for it is ever posted)
_DEFER_S = 0.002
_SPIN_US = 200  # default spin while every rank has a core: past a sleep's wake-up time
# with more ranks than cores: spin this long, yielding the core at every turn, then sleep
_SHARED_SPIN_US = 100
_NO_ROOM = "no room\n"             # published instead of a segment name when creation failed
_DTYPE_CODE = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
# what the compiled core reduces itself: (dtype, op) -> its codes (enums of _shmcore.c)
_CORE_DTYPES = ("float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                "uint32", "uint64")
_CORE_OPS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG,
             ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def _defined(op: ReduceOp, dtype: np.dtype) -> bool:
    try:
        check_reduce_op(op, dtype)
    except UnsupportedError:
        return False
    return True


CORE_REDUCTIONS = {(np.dtype(d), op): (i, k) for i, d in enumerate(_CORE_DTYPES)
                    for k, op in enumerate(_CORE_OPS) if _defined(op, np.dtype(d))}
_NAMES = ("an operation", *COLLECTIVES, "barrier", "send", "recv", "batch", "sendrecv")
_NAME_CODE = {name: i for i, name in enumerate(_NAMES)}
# the hot path's "doing" word of each operation, less its sequence number
_DOING = {name: code << 1 | 1 for name, code in _NAME_CODE.items()}


class _Steps:
    """The staging half used last and the last barrier's count, where the core's Staging does
    not keep them (the Python path, a communicator of one rank)."""

    __slots__ = ("half", "epoch")

    def __init__(self) -> None:
        self.half, self.epoch = 1, 0

    def close(self) -> None:
        """As Staging.close; these counters hold no address."""


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class _Layout:
    """Byte offsets inside one segment of a communicator of `size` ranks."""

    def __init__(self, size: int, staging_bytes: int, channel_bytes: int) -> None:
        self.size = size
        self.w_consumed = _W_SENT + size  # words: bytes this rank consumed from channel of j
        self.w_published = self.w_consumed + size  # words: (address, bytes) of the current op's
        # arrays, then the messages this rank read directly out of each rank's memory, then the
        # reason this rank gave for refusing its arguments
        self.w_read = self.w_published + 2 * size
        self.refusal = (self.w_read + size) * 8
        self.control = _round_up(self.refusal + _REFUSAL_BYTES, 4096)
        self.channel_bytes = channel_bytes
        self.channels = self.control
        self.staging_bytes = staging_bytes
        self.staging = _round_up(self.channels + size * channel_bytes, 4096)
        self.total = self.staging + 2 * staging_bytes


class SharedMemoryFull(OSError):
    """/dev/shm has no room for a segment (raised at creation, never later as SIGBUS)."""


def _claim(fd: int, size: int) -> None:
    """Give the segment `size` bytes and claim its pages now: a tmpfs segment that is only
    truncated gets its pages on first touch, and a full /dev/shm then kills the rank with
    SIGBUS mid-collective instead of failing here."""
    os.ftruncate(fd, size)
    if not hasattr(os, "posix_fallocate"):  # macOS: nothing to claim pages with
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SharedMemoryFull(e.errno, os.strerror(e.errno)) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def no_room_message(rank: int, size: int, segment_bytes: int, layout: _Layout,
                    directory: str = "/dev/shm") -> str:
    """What rank `rank` says when /dev/shm cannot hold its segment: what the job needs, what
    there is, and the ways out."""
    try:
        fs = os.statvfs(directory)
        there = (f"{directory} has {format_bytes(fs.f_bavail * fs.f_frsize)} free of "
                 f"{format_bytes(fs.f_blocks * fs.f_frsize)}")
    except OSError:
        there = f"{directory} could not be measured"
    return (
        f"rank {rank}: no room in shared memory: this communicator's {size} ranks need "
        f"{size} x {format_bytes(segment_bytes)} = {format_bytes(size * segment_bytes)} "
        f"({format_bytes(2 * layout.staging_bytes)} of staging and "
        f"{size} x {format_bytes(layout.channel_bytes)} of message channels per rank), and "
        f"{there}. Give the job more (in a container: `docker run --shm-size=1g`, or a "
        f"memory-backed emptyDir at /dev/shm on Kubernetes), use smaller segments "
        f"(ANYCCL_SHM_STAGING_BYTES, ANYCCL_SHM_CHANNEL_BYTES, e.g. 256K each), or use "
        f"backend='mpi'")


class _Segment:
    """One mapped shared-memory segment; created (and later unlinked) by its owner."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        self.name = name
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open(name, flags, mode=0o600)
        try:
            if not create:
                _check_owner(fd, name)
            if create:
                try:
                    _claim(fd, size)
                except BaseException:
                    _posixshmem.shm_unlink(name)
                    raise
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.u8 = np.frombuffer(self.mm, dtype=np.uint8)
        self.words = memoryview(self.mm).cast("Q")

    def address(self, offset: int) -> int:
        return self.u8.ctypes.data + offset

    def unlink(self) -> None:
        try:
            _posixshmem.shm_unlink(self.name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.words.release()
        self.u8 = None
        try:
            self.mm.close()
        except BufferError:  # a user still holds a view; the mapping goes with the last one
            pass


def _check_owner(fd: int, name: str) -> None:
    """A peer's segment is mapped only if it is a file of this user that no one else may read
    or write (mode 0600), checked on the open descriptor: a segment another local user
    published under a job's name is refused, never read from or written to."""
    info = os.fstat(fd)
    mode = info.st_mode & 0o777
    if info.st_uid != os.geteuid() or mode != 0o600:
        raise RendezvousError(
            f"refusing to map shared memory {name}: it belongs to uid {info.st_uid} with mode "
            f"{mode:04o}, but a segment of this job belongs to this user (uid {os.geteuid()}) "
            f"with mode 0600; another local user may be trying to enter the job")


def reclaim_dead_segments(directory: str = "/dev/shm") -> list[str]:
    """Unlink anyccl segments whose creator has died before unlinking them (a crash during
    start-up). Only segments this user can open, with a valid header, and whose creating
    process no longer exists are touched; live jobs' segments are left alone."""
    import glob

    removed = []
    for path in glob.glob(os.path.join(directory, "anyccl-*")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                if os.fstat(fd).st_uid != os.geteuid():
                    continue
                header = os.read(fd, 16)
            finally:
                os.close(fd)
        except OSError:  # another user's (mode 0600), a link, or already gone
            continue
        if len(header) < 16:
            continue
        magic, pid = np.frombuffer(header, np.uint64)
        if int(magic) != _MAGIC or pid == 0 or process_alive(int(pid)):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


class _Send:
    """A message on its way: streamed through the channel after its header; or, `direct`,
    the header alone, which tells the receiver where to read the data in this process (then
    the send is done once the receiver says it read it: `ticket`, its count of such reads)."""

    __slots__ = ("data", "header", "total", "written", "record", "deadline", "on_done",
                 "direct", "ticket")

    def __init__(self, data, tag, dtype, record, on_done, direct=False):
        self.data = data
        self.direct, self.ticket = direct, 0
        self.header = (tag, data.size, _DTYPE_CODE[dtype], data.ctypes.data if direct else 0)
        self.total = _HEADER + (0 if direct else _round_up(data.size, _HEADER))
        self.written = 0
        self.record, self.deadline, self.on_done = record, record.deadline, on_done


class _Recv:
    __slots__ = ("data", "tag", "dtype", "record", "deadline", "on_done", "order", "found")

    def __init__(self, data, tag, dtype, record, on_done, order, found):
        self.data, self.tag, self.dtype = data, tag, dtype
        self.record, self.deadline, self.on_done = record, record.deadline, on_done
        self.order = order    # when it was posted: the earliest fitting receive takes a message
        self.found = found    # a receive from any rank: told the sender


class _Incoming:
    """A message being read from a channel: into a posted receive, or buffered until one comes.
    A direct message's `address` in its sender is kept (non-zero) until its data is read."""

    __slots__ = ("tag", "nbytes", "dtype", "sink", "received", "stream_bytes", "target", "error",
                 "arrival", "address", "since")

    def __init__(self, tag: int, nbytes: int, dtype: np.dtype, arrival: int,
                 address: int = 0) -> None:
        self.tag, self.nbytes, self.dtype, self.arrival = tag, nbytes, dtype, arrival
        self.address, self.since = address, 0.0
        self.stream_bytes = 0 if address else _round_up(nbytes, _HEADER)
        self.received = 0
        self.sink: np.ndarray | None = None
        self.target: _Recv | None = None
        self.error: BaseException | None = None


def channel_bytes(size: int) -> int:
    """Each message ring's bytes on `size` ranks (the same on every rank):
    ANYCCL_SHM_CHANNEL_BYTES where set; else on 2 ranks 4 MiB and room for a message's header,
    so that a message of up to 4 MiB goes whole, one copy in and one out (2 rings per rank),
    and 1 MiB on more, where the rings grow with the ranks (results:
    2026-11-28-ci2core-shm-4mib-message-rings-on-2-ranks.md)."""
    if settings.SHM_CHANNEL_BYTES.is_set():
        return settings.SHM_CHANNEL_BYTES.get()
    return (4 << 20) + _HEADER if size == 2 else 1 << 20


class SharedMemoryBackend(Backend):
    """The shm transport for one communicator (see the module docstring)."""

    name = "shm"

    def __init__(self, store: Store, rank: int, size: int, *, job_id: str, comm_name: str,
                 timeout_s: float) -> None:
        if _posixshmem is None:
            raise RendezvousError("the shm backend needs POSIX shared memory")
        self.rank, self.size = rank, size
        self._layout = layout = _Layout(
            size, _round_up(settings.SHM_STAGING_BYTES.get(), 4096),
            _round_up(channel_bytes(size), _HEADER))
        self.half_bytes = layout.staging_bytes
        self._store, self._job_id, self._timeout_s = store, job_id, timeout_s
        # more ranks than cores: a spin that pauses holds the core the awaited peer needs, so
        # spins yield it at every turn instead (as MPICH's polling does when oversubscribed)
        self._yields = size > cores_available()
        if _shmcore is not None:
            _shmcore.set_spin_yield(self._yields)
        spin_us = settings.SPIN_US.get()
        if spin_us is None:
            spin_us = _SHARED_SPIN_US if self._yields else _SPIN_US
        self._spin_ns = int(spin_us * 1000)
        # the staging half used last and the last barrier's count: the core's Staging, which
        # also runs the one-shot step, once the lanes are known (below); else these
        self._steps: _Steps | Any = _Steps()
        self._record: OpRecord | None = None
        self._posted_of_record = 0   # its messages posted and not yet done (`_waits_in`)
        self._deadline = float("inf")
        self._agree: tuple | None = None   # the signature the next barrier carries
        self._half_before = 1
        self._closed = False
        self._next_peer_check = self._next_deadline_check = 0.0
        self._doing = 0
        if comm_name == WORLD:
            reclaim_dead_segments()

        part = comm_name.replace("/", ".")  # a POSIX shared-memory name has one slash
        name = f"/anyccl-{job_id}-{part}-{rank}-{secrets.token_hex(4)}"
        try:
            self._own = _Segment(name, layout.total, create=True)
        except SharedMemoryFull:
            message = no_room_message(rank, size, layout.total, layout)
            store.set(f"shm/{rank}", f"{_NO_ROOM}{message}".encode())  # peers fail at once too
            raise RendezvousError(message) from None
        try:
            self._own.words[_W_PID] = os.getpid()
            self._own.words[_W_SEGMENT_ADDRESS] = self._own.address(0)
            self._bell = self.doorbell = Doorbell(self._own.address(_BELL_OFFSET), create=True)
            self._own.words[_W_MAGIC] = _MAGIC
            self._segments = self._rendezvous(store, name, timeout_s)
        except BaseException:
            self._own.close()
            self._own.unlink()
            raise
        self._words = self._own.words   # this rank's control block
        self._bell.spin_s, self._bell.yields = self._spin_ns * 1e-9, self._yields
        self._ctl = [seg.words for seg in self._segments]
        self._bells = [Doorbell(seg.address(_BELL_OFFSET), create=False)
                       for seg in self._segments]
        self._peer_bells = [bell for j, bell in enumerate(self._bells) if j != rank]
        self._peer_ctl = [ctl for j, ctl in enumerate(self._ctl) if j != rank]
        self._typed: dict[tuple[int, np.dtype, int | None], list[np.ndarray]] = {}
        self._staging = [[seg.u8[layout.staging + h * layout.staging_bytes:
                                 layout.staging + (h + 1) * layout.staging_bytes]
                          for h in (0, 1)] for seg in self._segments]
        cb = layout.channel_bytes
        self._rings = [seg.u8[layout.channels + self.rank * cb: layout.channels + (self.rank + 1)
                              * cb] for seg in self._segments]  # rings[j]: channel j -> me
        self._out_rings = [self._own.u8[layout.channels + j * cb: layout.channels + (j + 1) * cb]
                           for j in range(size)]
        # a message larger than a ring streams through it in pieces of a quarter of it, each
        # published as it is written or read: the sender refills what the receiver has read
        # while the receiver reads on (whole rings at a time, the two copies took turns)
        self._piece = max(_HEADER, cb // 4 // _HEADER * _HEADER)
        self._sent = [0] * size
        self._consumed = [0] * size
        self._sendq: list[deque[_Send]] = [deque() for _ in range(size)]
        # direct sends whose header went, until the receiver read them; the direct reads
        # this rank made of each sender's memory, and asked for of each receiver
        self._unread: list[deque[_Send]] = [deque() for _ in range(size)]
        self._read = [0] * size
        self._tickets = [0] * size
        self._posted: list[list[_Recv]] = [[] for _ in range(size)]
        self._posted_any: list[_Recv] = []   # receives from any rank, in the order posted
        self._posts = self._arrivals = 0     # receives posted and message headers read so far
        self._unexpected: list[list[_Incoming]] = [[] for _ in range(size)]
        # direct messages no receive has claimed yet, still in their senders' memory, in order
        self._deferred: list[deque[_Incoming]] = [deque() for _ in range(size)]
        self._incoming: list[_Incoming | None] = [None] * size
        self._pids = [int(ctl[_W_PID]) for ctl in self._ctl]
        self.liveness.add(self._dead_peers)
        self._scratch = np.empty(0, np.uint8)
        self._core = _shmcore   # None where it could not be built: the Python path
        # the tuning table's thresholds (tuning.py), read once
        self.one_shot_max_bytes = tuning.value("shm.one_shot_max")
        self.chunk_bytes = tuning.value("shm.direct_chunk")
        self.block_bytes = tuning.value("shm.direct_block")
        # with more ranks than cores, every piece of a streamed message waits for its peer to
        # get a core: there any message larger than its channel is read directly
        self._direct_message_min = 0 if self._yields else tuning.value("shm.direct_min.message")
        self._direct_min = {op: tuning.value(f"shm.direct_min.{op}")
                            for op in ("all_reduce", "broadcast", "all_gather", "gather",
                                       "scatter")}
        self._core_max_bytes = min(self.half_bytes, self.one_shot_max_bytes)
        # what the core reads and writes, as addresses (the mappings live as long as self)
        self._half_at = [tuple(self._staging[j][h].ctypes.data for j in range(size))
                         for h in (0, 1)]
        self._arrive_at = self._own.address(_W_ARRIVE * 8)
        # the two signature slots (barrier parity 0, 1): this rank's, and the peers'
        self._agree_at = [self._own.address((_W_AGREE + 2 * p) * 8) for p in (0, 1)]
        self._peer_agree_at = [tuple(seg.address((_W_AGREE + 2 * p) * 8)
                                     for j, seg in enumerate(self._segments) if j != rank)
                               for p in (0, 1)]
        self._peer_arrive_at = tuple(seg.address(_W_ARRIVE * 8)
                                     for j, seg in enumerate(self._segments) if j != rank)
        self._peer_bells_at = tuple(bell.address for bell in self._peer_bells)
        # what the core's one_shot reads, per staging half and barrier parity (2 * half + parity)
        self._lanes = [(self._half_at[h], rank, self._arrive_at, self._peer_bells_at,
                        self._agree_at[p], self._peer_arrive_at, self._peer_agree_at[p],
                        self._spin_ns) for h in (0, 1) for p in (0, 1)]
        # the core's Staging runs barriers and one-shot steps (not on the Python path, nor for
        # one rank, which has no peer to stage for)
        self._core_steps = self._core is not None and size > 1
        if self._core_steps:
            self._steps = self._core.Staging(tuple(self._lanes), self._own.address(_W_DOING * 8),
                                             self.half_bytes)
        else:
            self._core_max_bytes = -1
        self._bells_at = [bell.address for bell in self._bells]
        self._sent_at = [self._own.address((_W_SENT + j) * 8) for j in range(size)]
        self._consumed_at = [self._own.address((layout.w_consumed + j) * 8) for j in range(size)]
        # the peers' counters of what they sent to and consumed from this rank
        self._peer_sent_at = [seg.address((_W_SENT + rank) * 8) for seg in self._segments]
        self._peer_consumed_at = [seg.address((layout.w_consumed + rank) * 8)
                                  for seg in self._segments]
        self.direct, crowded = self._agree_on_cross_memory(store, timeout_s)
        if crowded:   # the same on every rank: agreed, as `direct`
            self._direct_min["broadcast"] = tuning.value("shm.direct_min.broadcast.crowded")
        # what the core's send and take read, per peer: (ring address, ring bytes, the peer's
        # counter, this rank's counter, the peer's doorbell)
        self._send_lanes = [(ring.ctypes.data, ring.size, self._peer_consumed_at[j],
                             self._sent_at[j], self._bells_at[j])
                            for j, ring in enumerate(self._out_rings)]
        self._take_lanes = [(ring.ctypes.data, ring.size, self._peer_sent_at[j],
                             self._consumed_at[j], self._bells_at[j])
                            for j, ring in enumerate(self._rings)]

    # ---- setup -----------------------------------------------------------------------------
    def _rendezvous(self, store: Store, name: str, timeout_s: float) -> list[_Segment]:
        host = socket.gethostname()
        store.set(f"shm/{self.rank}", f"{host}\n{name}".encode())
        segments: list[_Segment] = []
        try:
            for j in range(self.size):
                if j == self.rank:
                    segments.append(self._own)
                    continue
                published = store.get(f"shm/{j}", timeout_s).decode()
                if published.startswith(_NO_ROOM):
                    raise self._no_room_elsewhere(j, published)
                peer_host, peer_name = published.split("\n")
                if peer_host != host:
                    raise RendezvousError(
                        f"rank {self.rank}: the shm backend serves ranks of one machine, but rank "
                        f"{j} runs on {peer_host!r} and this rank on {host!r}; use "
                        f"backend='mpi' across machines")
                try:
                    seg = _Segment(peer_name, self._layout.total, create=False)
                except FileNotFoundError:  # its owner gave up and removed it: say why
                    raise self._start_up_failure(store, j) from None
                if seg.words[_W_MAGIC] != _MAGIC:
                    raise RendezvousError(f"rank {self.rank}: rank {j}'s segment is not ready")
                segments.append(seg)
            store.barrier("shm/attached", self.size, timeout_s)
        except BaseException:
            for seg in segments:
                if seg is not self._own:
                    seg.close()
            raise
        self._own.unlink()
        return segments

    def _no_room_elsewhere(self, j: int, published: str) -> RendezvousError:
        return RendezvousError(f"rank {self.rank}: rank {j} could not create its shared memory; "
                               f"it said: {published[len(_NO_ROOM):]}")

    def _start_up_failure(self, store: Store, j: int) -> RendezvousError:
        """Rank j's segment vanished during start-up: the reason a rank published, if one
        did (no room in /dev/shm), else that rank j gave up."""
        for q in range(self.size):
            if q != self.rank and store.check(f"shm/{q}"):
                published = store.get(f"shm/{q}", 1.0).decode()
                if published.startswith(_NO_ROOM):
                    return self._no_room_elsewhere(q, published)
        return RendezvousError(f"rank {self.rank}: rank {j}'s shared-memory segment vanished "
                               f"during start-up: rank {j} gave up or died")

    def _agree_on_cross_memory(self, store: Store, timeout_s: float) -> tuple[bool, bool]:
        """Whether every rank can read every peer's memory directly (probed, then agreed), and
        whether any rank has more ranks than cores (its waits yield), which every rank then
        knows alike (schedules chosen by it must be the same on every rank)."""
        ok = cross_memory.available()
        if ok:
            probe = np.zeros(1, np.uint64)
            for j, ctl in enumerate(self._ctl):
                if j == self.rank:
                    continue
                try:
                    cross_memory.read(self._pids[j], int(ctl[_W_SEGMENT_ADDRESS]), probe)
                except OSError:
                    ok = False
                    break
                ok &= int(probe[0]) == _MAGIC
        store.set(f"shm/cma/{self.rank}", f"{ok:d}{self._yields:d}".encode())
        said = [store.get(f"shm/cma/{j}", timeout_s) for j in range(self.size)]
        return all(s[:1] == b"1" for s in said), any(s[1:] == b"1" for s in said)

    def subgroup(self, ranks: list[int], name: str, timeout_s: float) -> Backend:
        from ..store import PrefixStore

        return SharedMemoryBackend(PrefixStore(name, self._store), ranks.index(self.rank),
                                   len(ranks), job_id=self._job_id, comm_name=name,
                                   timeout_s=timeout_s)

    # ---- waiting ---------------------------------------------------------------------------
    # What a rank does is two integers in its control block, written as each operation starts
    # and ends; the full text (arguments and all) only when it starts to sleep in a wait, which
    # is where a rank that holds the others up is found.
    def _enter(self, record: OpRecord) -> None:
        """Operation `record` starts on this rank (its first call: a composite backend's later
        calls with the same record continue it): what it is, for peers' messages, its
        deadline, and the signature its first sync carries."""
        if record is self._record:
            self._words[_W_DOING] = self._doing
            return
        self._record, self._deadline = record, record.deadline
        self._doing = doing = (record.seq << 24) | (_NAME_CODE.get(record.name, 0) << 1) | 1
        self._words[_W_DOING] = doing
        agree = self._agree = record.agree
        self._half_before = self._steps.half
        if agree is not None and len(agree) > 2:   # this rank refused: its reason, for peers
            self._write_refusal(agree[2])

    def _idle(self) -> None:
        """This rank finished its operation (what peers see while it is idle)."""
        self._words[_W_DOING] = self._doing & ~1

    def _describe_waiting(self) -> None:
        """Write the text of the operation this rank is in, for peers' error messages."""
        own = self._own.words
        if self._record is None or own[_W_STATUS_FOR] == self._doing:
            return
        data = str(self._record).encode()[:_STATUS_BYTES]
        self._own.u8[_STATUS_OFFSET:_STATUS_OFFSET + len(data)] = np.frombuffer(data, np.uint8)
        own[_W_STATUS_LEN] = len(data)
        own[_W_STATUS_FOR] = self._doing

    def peer_status(self, j: int) -> str:
        """What rank `j` is doing, as the rest of "rank j ...": "is in all_reduce(...) #7",
        "is idle after barrier() #3", "has started no operation yet"."""
        ctl = self._ctl[j]
        doing = int(ctl[_W_DOING])
        if not doing:
            return "has started no operation yet"
        if int(ctl[_W_STATUS_FOR]) == doing | 1:  # it waited in this operation: the full text
            n = min(int(ctl[_W_STATUS_LEN]), _STATUS_BYTES)
            op = bytes(self._segments[j].u8[_STATUS_OFFSET:_STATUS_OFFSET + n]).decode(
                errors="replace")
        else:
            code = (doing >> 1) & 0x7FFFFF
            op = f"{_NAMES[code] if code < len(_NAMES) else _NAMES[0]}() #{doing >> 24}"
        return f"is in {op}" if doing & 1 else f"is idle after {op}"

    def _wait_until(self, ready: Callable[[], bool], record: OpRecord | None, deadline: float,
                    waiting_for: Callable[[], str], spin: bool = True) -> None:
        """Return once `ready()`; progress messages meanwhile; raise on deadline or lost peer.
        `spin`: spin first (False: the caller has spun already)."""
        if ready():
            return
        spin_end = time.perf_counter() + (self._spin_ns * 1e-9 if spin else 0.0)
        while time.perf_counter() < spin_end:
            if ready():
                return
            if self._yields:
                os.sched_yield()
        # peers are checked (a /proc read each) only once a wait has lasted a while: a check
        # on every short wait slowed this rank enough to make its peers wait in turn
        next_check = time.monotonic() + _PEER_CHECK_S
        self._describe_waiting()
        while True:
            self._bell.drain()
            progressed = self._progress_messages()
            if ready():
                return
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout_error(record, waiting_for())
            if now >= next_check:
                try:
                    self._check_peers()
                except PeerLostError:
                    # A peer may finish its part and close between our check and this one:
                    # everything it published precedes its closed flag, so look once more.
                    if ready():
                        return
                    raise
                next_check = now + _PEER_CHECK_S
            if not progressed:
                self._bell.sleep(min(deadline - now, _PEER_CHECK_S))

    def _timeout_error(self, record: OpRecord | None, waiting_for: str) -> TimeoutError:
        waited = time.monotonic() - record.issued_at if record else self._timeout_s
        peers = "; ".join(f"rank {j} {self.peer_status(j)}"
                          for j in range(self.size) if j != self.rank)
        error = TimeoutError(f"rank {self.rank}: {record} timed out after {waited:.3g} s waiting "
                             f"for {waiting_for}" + (f"; {peers}" if peers else ""))
        error.waited_for = tuple(j for j in range(self.size)
                                 if j != self.rank and not int(self._ctl[j][_W_DOING]) & 1)
        return error

    def _check_peers(self) -> None:
        if self._own.words[_W_CLOSED]:   # this rank revoked it (abort, shrink): wait no more
            raise CommunicatorClosedError(f"rank {self.rank}: {self._record} was cut short: "
                                          f"this rank aborted or revoked the communicator")
        # a death first: a peer that closed may only have reacted to that death
        lost = self.lost_peer()
        if lost is not None:
            origin = self._origin(lost[0])
            after = "" if origin == lost[0] else f" ({lost[1]} after losing it)"
            if origin == lost[0] or not process_alive(self._pids[origin]):
                # the first rank lost died: name its death, not an exit it caused
                raise self._lost(origin, f"rank {origin} (pid {self._pids[origin]}) "
                                         f"{self._gone(origin)} while this rank was in "
                                         f"{self._record}{after}")
            raise self._lost(origin, f"rank {origin} left while this rank was in "
                                     f"{self._record}{after}")
        for j in range(self.size):
            if j != self.rank and self._ctl[j][_W_CLOSED]:
                origin = self._origin(j)
                if origin == j:
                    raise self._lost(j, f"rank {j} closed its communicator while this rank was "
                                        f"in {self._record}")
                raise self._lost(origin, f"rank {origin} left while this rank was in "
                                         f"{self._record} (rank {j}, which lost it, has closed)")

    def _origin(self, j: int) -> int:
        """The rank whose loss started the departures that reached rank j: each rank that
        reported a lost peer says which (in its control block), so every rank names the same
        first one, not a peer that only left because of it."""
        seen = {j}
        while True:
            lost = int(self._ctl[j][_W_LOST])
            if not lost or lost - 1 in seen or lost - 1 == self.rank:
                return j
            j = lost - 1
            seen.add(j)

    def _lost(self, j: int, what: str) -> PeerLostError:
        """The error for losing rank j, noted in this rank's control block for the others."""
        if not self._own.words[_W_LOST]:
            self._own.words[_W_LOST] = j + 1
        return PeerLostError(f"rank {self.rank}: {what}", j)

    def _dead_peers(self) -> dict[int, str]:
        """This transport's source for `liveness`: the peers whose process ended."""
        if self._closed:
            return {}
        return {j: f"rank {j} (pid {self._pids[j]}) {self._gone(j)}" for j in range(self.size)
                if j != self.rank and not process_alive(self._pids[j])}

    def _gone(self, j: int) -> str:
        """How rank j's process ended: after closing its communicator (a normal exit), or
        without (a crash, a signal, os._exit)."""
        return "closed its communicator and exited" if self._ctl[j][_W_CLOSED] else "died"

    # ---- staging interface of algorithms.symmetric ------------------------------------------
    def next_half(self) -> int:
        steps = self._steps
        steps.half ^= 1
        return steps.half

    def mine(self, half: int) -> np.ndarray:
        return self._staging[self.rank][half]

    def peer(self, rank: int, half: int) -> np.ndarray:
        return self._staging[rank][half]

    def typed(self, half: int, dtype: np.dtype, count: int | None = None) -> list[np.ndarray]:
        key = (half, dtype, count)
        try:
            return self._typed[key]
        except KeyError:
            pass
        if count is None:
            whole = self.half_bytes - self.half_bytes % dtype.itemsize
            views = [self._staging[r][half][:whole].view(dtype) for r in range(self.size)]
        else:
            views = [v[:count] for v in self.typed(half, dtype)]
            if len(self._typed) >= 256:  # the views of many sizes: start over
                self._typed.clear()
        self._typed[key] = views
        return views

    def barrier(self, record: OpRecord) -> None:
        self._enter(record)
        self.sync()
        self._idle()

    def sync(self) -> None:
        """Return once every rank has arrived. The first sync of a collective also carries
        its signature: written before the arrival, compared with every peer's right after, so
        every rank raises on a difference before any rank touches another's memory. (A rank
        rewrites the slot of this parity only at the barrier after next, which no rank passes
        before every rank has compared this one.)"""
        agree, self._agree = self._agree, None
        steps = self._steps
        if self._core_steps:   # arrive, spin and compare in one call
            status = steps.sync(agree)
            if status == 1:
                return
        else:
            steps.epoch += 1
            status = 0
        if agree is None:
            self._arrive_and_wait(steps.epoch)
        else:
            self._settle(steps.epoch, agree, status)

    def _settle(self, epoch: int, agree: tuple, reached: int) -> None:
        """The rest of a barrier that carries signature `agree`, after the core's arrival and
        spin (`reached`: -1, every rank arrived and a signature differs; 0, not all had
        arrived; without the core, nothing was done yet): arrive and wait as needed, then
        compare every peer's signature with this rank's."""
        word, count = agree[0] | (epoch & 0xFFFF) << 40, agree[1]
        slot = _W_AGREE + 2 * (epoch & 1)
        if self._core is None:
            self._own.words[slot], self._own.words[slot + 1] = word, count
        if not reached:
            self._arrive_and_wait(epoch)
        for ctl in self._peer_ctl:
            if ctl[slot] != word or ctl[slot + 1] != count:
                self._disagree(slot)

    def _arrive_and_wait(self, epoch: int) -> None:
        """The rest of barrier(): arrive (without the core), then wait for every peer."""
        peers, core = self._peer_ctl, self._core
        if core is None:
            self._own.words[_W_ARRIVE] = epoch
            for bell in self._peer_bells:
                bell.ring()
        self._wait_until(lambda: all(c[_W_ARRIVE] >= epoch for c in peers), self._record,
                         self._deadline, lambda: self._barrier_laggards(epoch),
                         spin=core is None)

    def _write_refusal(self, reason: str) -> None:
        data = reason.encode(errors="replace")[:_REFUSAL_BYTES - 8]
        at = self._layout.refusal
        self._own.u8[at + 8:at + 8 + len(data)] = np.frombuffer(data, np.uint8)
        self._own.u8[at:at + 8] = np.frombuffer(struct.pack("<q", len(data)), np.uint8)

    def _disagree(self, slot: int) -> None:
        """The signatures at `slot` differ: every rank raises the same error, and leaves the
        staging halves as they were before the collective (no rank read or wrote a peer's),
        so the communicator stays usable."""
        self._steps.half = self._half_before
        words, reasons = [], {}
        at = self._layout.refusal
        for j, ctl in enumerate(self._ctl):
            word = int(ctl[slot]) & ~(0xFFFF << 40)
            words.append((word, int(ctl[slot + 1])))
            if word & agreement.REFUSED:
                seg = self._segments[j].u8
                n = min(struct.unpack("<q", bytes(seg[at:at + 8]))[0], _REFUSAL_BYTES - 8)
                reasons[j] = bytes(seg[at + 8:at + 8 + n]).decode(errors="replace")
        raise agreement.mismatch(self.rank, self._record, words, reasons, self.name)

    def _barrier_laggards(self, epoch: int) -> str:
        late = [j for j, c in enumerate(self._ctl) if c[_W_ARRIVE] < epoch]
        return "rank " + ", ".join(map(str, late)) + " to arrive"

    # ---- direct-access interface of algorithms.direct ---------------------------------------
    def publish(self, arrays: list[np.ndarray]) -> None:
        words, base = self._own.words, self._layout.w_published
        for i, a in enumerate(arrays):
            words[base + 2 * i], words[base + 2 * i + 1] = a.ctypes.data, a.nbytes
        for i in range(len(arrays), self.size):
            words[base + 2 * i + 1] = 0

    def addresses(self, rank: int) -> list[int]:
        words, base = self._ctl[rank], self._layout.w_published
        return [int(words[base + 2 * i]) for i in range(self.size)]

    def _bounded(self, rank: int, address: int, nbytes: int, verb: str) -> int:
        """Rank `rank`'s pid, once [address, address + nbytes) lies inside an array it
        published for this collective; else an error, and no byte is copied: a copy into or
        out of another process is bounded by what that process declared."""
        words, base = self._ctl[rank], self._layout.w_published
        for i in range(self.size):
            start, length = int(words[base + 2 * i]), int(words[base + 2 * i + 1])
            if length and start <= address and address + nbytes <= start + length:
                return self._pids[rank]
        raise agreement.out_of_bounds(self.rank, self._record, rank, verb, nbytes)

    def read(self, rank: int, address: int, dst: np.ndarray) -> None:
        self._copy(cross_memory.read, rank, address, dst, "read")

    def write(self, rank: int, address: int, src: np.ndarray) -> None:
        self._copy(cross_memory.write, rank, address, src, "write")

    def _copy(self, move: Callable, rank: int, address: int, data: np.ndarray, verb: str) -> None:
        pid = self._bounded(rank, address, data.nbytes, verb)
        try:
            move(pid, address, data)
        except OSError as exc:
            # the peer's process is gone (ESRCH) or its mapping with it (EFAULT): a lost peer
            # if it died; anything else is reported as what it is, naming the peer
            if not process_alive(pid) or self._ctl[rank][_W_CLOSED]:
                raise self._lost(rank, f"rank {rank} (pid {pid}) {self._gone(rank)} while "
                                       f"this rank was in {self._record}") from None
            raise PeerLostError(f"rank {self.rank}: {self._record}: a direct {verb} of "
                                f"{format_bytes(data.nbytes)} from rank {rank}'s memory failed: "
                                f"{exc}", rank) from None

    def scratch(self, nbytes: int) -> np.ndarray:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch

    def _direct_for(self, op: str, nbytes: int) -> bool:
        # the same answer on every rank: `direct` is agreed and nbytes is the same everywhere
        return self.direct and self.size > 1 and nbytes >= self._direct_min[op]

    # ---- collectives -------------------------------------------------------------------------
    def _hot(self, record: OpRecord, nbytes: int) -> bool:
        """Whether `record` takes the hot path (`_core_step`): a new operation (not a later
        call of a composite backend's), with the compiled core, that fits one staging half,
        on a rank that did not refuse it (a refusal's reason is written by `_enter`)."""
        agree = record.agree
        return self._core_steps and nbytes <= self._core_max_bytes and \
            record is not self._record and (agree is None or len(agree) == 2)

    def _core_step(self, x: np.ndarray, record: OpRecord, doing: int, codes: tuple[int, int],
                   reduce_here: bool, source: int, gathered: np.ndarray | None = None) -> int:
        """The hot path of a new operation whose one-shot step the core runs whole (`_enter`,
        `_one_shot` and `_idle` in one): this rank marked in it (`doing`: the operation's
        word, less its sequence number), the step run, finished here where the peers were not
        there within the core's spin. Returns the core's status: 1 where it finished the step
        itself (and filled `gathered`)."""
        self._record, self._agree = record, None
        self._doing = doing = (record.seq << 24) | doing
        status = self._steps.one_shot(x, doing, record.agree, codes[0], codes[1], reduce_here,
                                      source, gathered)
        if status != 1:
            self._core_step_rest(x, record, codes, reduce_here, source, status)
        return status

    def _core_step_rest(self, x: np.ndarray, record: OpRecord, codes: tuple[int, int],
                        reduce_here: bool, source: int, status: int) -> None:
        """What is left of a hot step the core began (`status` 0 or -1): wait, compare,
        reduce or copy, then idle."""
        self._deadline, self._half_before = record.deadline, self._steps.half ^ 1
        self._one_shot_rest(x, codes, reduce_here, source, record.agree, status)
        self._idle()

    def hot_context(self, engine: Any,
                    log: Callable[[OpRecord], Any]) -> tuple[Callable, tuple] | None:
        """`_shmcore.hot` and its context: the blocking all_reduce, broadcast and all_gather
        (into one array) that take the hot path (`_core_step`) run whole in one compiled call,
        from the communicator's checks to the record's end. None without the compiled core or
        on one rank."""
        if not self._core_steps:
            return None
        never = 1 << 62

        def direct_min(op: str) -> int:
            return self._direct_min[op] if self.direct else never

        more = {"all_reduce": ", op={0.name}", "broadcast": ", src={}", "all_gather": ""}
        kinds = tuple((name, agreement.NAME_BITS[name], _DOING[name], more[name],
                       direct_min(name)) for name in self.HOT_KINDS)
        return self._core.hot, (engine, self, self._steps, log, OpRecord, about_text,
                                agreement.DTYPE_BITS, CORE_REDUCTIONS, np.ndarray, ReduceOp,
                                float(engine.timeout_s), self._core_max_bytes, kinds,
                                self._hot_rest, engine.failed)

    def exchange_context(self, engine: Any, log: Callable[[OpRecord], Any],
                         seqs: Any) -> tuple[Callable, tuple] | None:
        """`_shmcore.exchange` and its context: a blocking sendrecv whose send fits dst's ring
        and whose message from src is the next there runs whole in one compiled call (the
        core's send and take, as send_now and receive_now), from the communicator's checks to
        the record's end. None without the compiled core."""
        if self._core is None or self.size == 1:
            return None
        return self._core.exchange, (engine, self, log, OpRecord, message_text, seqs,
                                     _DTYPE_CODE, np.ndarray, engine.exchange_rest,
                                     engine.exchange_failed, "sendrecv", self.rank, self.size,
                                     None)

    def _hot_rest(self, x: np.ndarray, record: OpRecord, arg: Any, status: int) -> None:
        """`_core_step_rest` for `_shmcore.hot`: arg is a broadcast's source rank, an
        all_reduce's op or an all_gather's output (then its pieces are copied out here)."""
        x = x.reshape(-1)
        if type(arg) is int:
            self._core_step_rest(x.view(np.uint8), record, (0, 0), False, arg, status)
        elif type(arg) is np.ndarray:
            self._core_step_rest(x.view(np.uint8), record, (0, 0), False, -1, status)
            self._gathered(list(arg.reshape(self.size, -1)), x)
        else:
            self._core_step_rest(x, record, CORE_REDUCTIONS[(x.dtype, arg)], True, -1, status)

    def all_reduce(self, x: np.ndarray, op: ReduceOp, record: OpRecord) -> None:
        codes = CORE_REDUCTIONS.get((x.dtype, op))
        if codes is not None and self._hot(record, x.nbytes):
            self._core_step(x, record, _DOING["all_reduce"], codes, True, -1)
            return
        self._enter(record)
        if not self._core_one_shot(x, op, None):
            if self._direct_for("all_reduce", x.nbytes):
                direct.all_reduce(self, x, op)
            else:
                symmetric.all_reduce(self, x, op)
        self._idle()

    def reduce(self, x: np.ndarray, root: int, op: ReduceOp, record: OpRecord) -> None:
        self._enter(record)
        if not self._core_one_shot(x, op, root):
            symmetric.all_reduce(self, x, op, root=root)
        self._idle()

    def _core_one_shot(self, x: np.ndarray, op: ReduceOp, root: int | None) -> bool:
        """`symmetric`'s one-shot schedule for a message that fits one staging half, step for
        step (stage, barrier, reduce in rank order), run by the compiled core in one call;
        False (nothing done) without the core, where it does not reduce this dtype and op, or
        for a larger message."""
        codes = CORE_REDUCTIONS.get((x.dtype, op))
        if codes is None or x.nbytes > self._core_max_bytes:
            return False
        self._one_shot(x, codes, root is None or root == self.rank, -1)
        return True

    def _one_shot(self, x: np.ndarray, codes: tuple[int, int], reduce_here: bool,
                  source: int) -> None:
        """One staging half's one-shot step (`_shmcore.Staging.one_shot`: stage, arrive with
        the signature, spin, compare, then reduce, or copy from `source` >= 0), finished here
        where the peers were not there within the spin."""
        agree, self._agree = self._agree, None
        status = self._steps.one_shot(x, self._doing, agree, codes[0], codes[1], reduce_here,
                                      source)
        if status != 1:
            self._one_shot_rest(x, codes, reduce_here, source, agree, status)

    def _one_shot_rest(self, x: np.ndarray, codes: tuple[int, int], reduce_here: bool,
                       source: int, agree: tuple | None, status: int) -> None:
        """The rest of a one-shot step the core began (`status` 0: the peers had not arrived
        within its spin; -1: they had, and a signature differs): wait, compare, then reduce or
        copy from the staging half it used."""
        steps = self._steps
        if agree is not None:
            self._settle(steps.epoch, agree, status)
        elif not status:
            self._arrive_and_wait(steps.epoch)
        if source >= 0:
            if source != self.rank:
                x[...] = self._staging[source][steps.half][:x.size]
        elif reduce_here:
            self._core.reduce(x, self._half_at[steps.half], x.size, codes[0], codes[1],
                              self.size)

    def broadcast(self, x: np.ndarray, root: int, record: OpRecord) -> None:
        if not self._direct_for("broadcast", x.nbytes) and self._hot(record, x.nbytes):
            self._core_step(x.view(np.uint8), record, _DOING["broadcast"], (0, 0), False, root)
            return
        self._enter(record)
        if self._direct_for("broadcast", x.nbytes):
            direct.broadcast(self, x, root)
        elif self._core_steps and x.nbytes <= self.half_bytes:
            # one chunk: symmetric.broadcast's steps, in C
            self._one_shot(x.view(np.uint8), (0, 0), False, root)
        else:
            symmetric.broadcast(self, x, root)
        self._idle()

    def all_gather(self, outs: list[np.ndarray], x: np.ndarray, record: OpRecord) -> None:
        # one chunk: every rank stages its piece and arrives (the core's one-shot step), then
        # reads every piece from the staging halves (safe until the next operation's barrier,
        # which no rank passes before reading); on the hot path the core copies them into one
        # contiguous output itself, once every rank arrived within its spin
        one_chunk = not self._direct_for("all_gather", x.nbytes)
        if one_chunk and self._hot(record, x.nbytes):
            whole = getattr(outs, "whole", None)
            into = whole.view(np.uint8) if isinstance(whole, np.ndarray) and \
                whole.flags.c_contiguous else None
            if self._core_step(x.view(np.uint8), record, _DOING["all_gather"], (0, 0), False,
                               -1, into) != 1 or into is None:
                self._gathered(outs, x)
            return
        self._enter(record)
        if not one_chunk:
            direct.all_gather(self, outs, x)
        elif self._core_steps and x.nbytes <= self._core_max_bytes:
            self._one_shot(x.view(np.uint8), (0, 0), False, -1)
            self._gathered(outs, x)
        else:
            symmetric.all_gather(self, outs, x)
        self._idle()

    def _gathered(self, outs: list[np.ndarray], x: np.ndarray) -> None:
        """Every rank's piece of the one-shot step just done, from the staging halves into
        `outs` (this rank's own left where it is `x`, in place)."""
        half, n = self._steps.half, x.nbytes
        for j, out in enumerate(outs):
            if j != self.rank or not np.may_share_memory(out, x):
                out.view(np.uint8)[...] = self._staging[j][half][:n]

    def gather(self, x: np.ndarray, outs: list[np.ndarray] | None, root: int,
               record: OpRecord) -> None:
        self._enter(record)
        if self._direct_for("gather", x.nbytes):
            direct.gather(self, outs, x, root)
        else:
            symmetric.all_gather(self, outs, x, root)
        self._idle()

    def scatter(self, out: np.ndarray, chunks: list[np.ndarray] | None, root: int,
                record: OpRecord) -> None:
        self._enter(record)
        (direct if self._direct_for("scatter", out.nbytes) else symmetric).scatter(
            self, out, chunks, root)
        self._idle()

    def reduce_scatter(self, out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp,
                       record: OpRecord) -> None:
        self._enter(record)
        symmetric.reduce_scatter(self, out, inputs, op)
        self._idle()

    def all_to_all(self, outs: list[np.ndarray], inputs: list[np.ndarray],
                   record: OpRecord) -> None:
        self._enter(record)
        symmetric.all_to_all(self, outs, inputs)
        self._idle()

    # ---- point to point ----------------------------------------------------------------------
    def send_now(self, x: np.ndarray, dst: int, tag: int) -> bool:
        """The compiled core's path: nothing queued for `dst` and the whole message fits in its
        ring's free space: written there in one call."""
        core = self._core
        if core is None or self._sendq[dst]:
            return False
        pos = core.send(self._send_lanes[dst], self._sent[dst], tag, _DTYPE_CODE[x.dtype], x)
        if not pos:
            return False
        self._sent[dst] = pos
        return True

    def post_send(self, x: np.ndarray, dst: int, tag: int, record: OpRecord,
                  on_done: Completion) -> None:
        if self.send_now(x, dst, tag):
            on_done(None)
            return
        self._waits_in(record)
        data = x.reshape(-1).view(np.uint8)
        self._sendq[dst].append(_Send(data, tag, x.dtype, record,
                                      self._until_done(record, on_done),
                                      self._direct_message(data.size, dst)))
        self._progress_send(dst)

    def _direct_message(self, nbytes: int, dst: int) -> bool:
        """Whether a message of `nbytes` to `dst` is read by the receiver straight out of this
        process's memory (one copy, as MPICH's large messages) rather than streamed through
        the channel: cross-memory attach works between the ranks, the message is larger than
        the channel (so that a send that could complete before its receive is posted still
        does) and, unless this host's ranks outnumber its cores, at least
        shm.direct_min.message."""
        return self.direct and nbytes >= self._direct_message_min and \
            _HEADER + _round_up(nbytes, _HEADER) > self._out_rings[dst].size

    def post_recv(self, x: np.ndarray, src: int | None, tag: int, record: OpRecord,
                  on_done: Completion, found: Callable[[int], None] | None = None) -> None:
        self._posts += 1
        self._waits_in(record)
        recv = _Recv(x.reshape(-1).view(np.uint8), tag, x.dtype, record,
                     self._until_done(record, on_done), self._posts, found)
        if src is None:   # the first message with the tag to have arrived, from any rank
            arrived = [(msg.arrival, j, msg) for j in range(self.size)
                       for msg in self._unexpected[j] if msg.tag == tag]
            if arrived:
                _, j, msg = min(arrived, key=lambda a: a[0])
                self._unexpected[j].remove(msg)
                self._claim(msg, recv, j)
                return
            self._posted_any.append(recv)
            self._progress_messages()
            return
        for msg in self._unexpected[src]:
            if msg.tag == tag:
                self._unexpected[src].remove(msg)
                self._claim(msg, recv, src)
                return
        self._posted[src].append(recv)
        self._progress_receive(src)

    def _waits_in(self, record: OpRecord) -> None:
        """A message of `record` is posted: this rank is in it (for peers' messages) until
        every message of it posted here is done (`_until_done`)."""
        if record is not self._record:
            self._posted_of_record = 0
        self._enter(record)   # (a message carries no signature: nothing for a sync to check)
        self._posted_of_record += 1

    def _until_done(self, record: OpRecord, on_done: Completion) -> Completion:
        """`on_done`, after which this rank is idle if `record` is still what it is in and
        this was its last posted message (a sendrecv waiting for its receive is still in it
        after its send went)."""
        def done(error: BaseException | None) -> None:
            if record is self._record:
                self._posted_of_record -= 1
                if not self._posted_of_record and error is None:
                    self._idle()
            on_done(error)
        return done

    def progress(self) -> None:
        self._progress_messages()
        now = time.monotonic()
        if now >= self._next_peer_check:
            self._next_peer_check = now + _PEER_CHECK_S
            self._check_peers()
        if now < self._next_deadline_check:  # deadlines are seconds away: a look per ms will do
            return
        self._next_deadline_check = now + _DEADLINE_CHECK_S
        self._take_stale_deferred(now)
        if self._words[_W_DOING] & 1:   # a message has waited a while: say what in, for peers
            self._describe_waiting()
        for queue in (*self._sendq, *self._unread, *self._posted, self._posted_any):
            for req in list(queue):
                if now >= req.deadline:
                    queue.remove(req)
                    req.on_done(self._timeout_error(req.record, "its peer"))

    def abort(self, error: BaseException) -> None:
        self._discard_deferred()
        for queue in (*self._sendq, *self._unread, *self._posted, self._posted_any):
            while queue:
                queue.pop().on_done(error)
        for msg in self._incoming:
            if msg is not None and msg.target is not None:
                msg.target.on_done(error)
                msg.target = None

    def _progress_messages(self) -> bool:
        moved = False
        for j in range(self.size):
            if j == self.rank:
                continue
            if self._sendq[j]:
                moved |= self._progress_send(j)
            if self._unread[j]:
                moved |= self._progress_read(j)
            if self._ctl[j][_W_SENT + self.rank] != self._consumed[j]:
                moved |= self._progress_receive(j)
        return moved

    def _progress_send(self, dst: int) -> bool:
        queue, ring = self._sendq[dst], self._out_rings[dst]
        cap, moved = ring.size, False
        while queue:
            msg = queue[0]
            free = cap - (self._sent[dst] - self._ctl[dst][self._layout.w_consumed + self.rank])
            if msg.written == 0 and free < _HEADER:
                break
            n = min(free, msg.total - msg.written, self._piece)
            if n <= 0:
                break
            pos = self._sent[dst]
            lo, hi = msg.written, msg.written + n
            if lo < _HEADER:  # whole, and never across the ring's end (both multiples of it)
                _HEADER_WORDS.pack_into(ring, pos % cap, *msg.header)
            a, b = max(lo, _HEADER) - _HEADER, min(hi - _HEADER, msg.data.size)
            if b > a:
                _ring_write(ring, pos + (a + _HEADER - lo), msg.data[a:b])
            msg.written = hi
            self._sent[dst] = pos + n
            self._own.words[_W_SENT + dst] = pos + n
            self._bells[dst].ring()
            moved = True
            if msg.written == msg.total:
                queue.popleft()
                if msg.direct:   # done once the receiver read it
                    self._tickets[dst] += 1
                    msg.ticket = self._tickets[dst]
                    self._unread[dst].append(msg)
                    self._progress_read(dst)
                else:
                    msg.on_done(None)
        return moved

    def _progress_read(self, dst: int) -> bool:
        """Complete the direct sends to `dst` that it has read (its count of reads)."""
        unread, moved = self._unread[dst], False
        done = self._ctl[dst][self._layout.w_read + self.rank]
        while unread and unread[0].ticket <= done:
            unread.popleft().on_done(None)
            moved = True
        return moved

    def _take_whole(self, src: int) -> bool:
        """The compiled core's path for the common case: the next message from `src` is whole
        in the ring and is for the one receive posted for it (same tag, dtype and size): copied
        straight into that receive. False, with nothing changed, in every other case."""
        posted = self._posted[src]
        if self._core is None or len(posted) != 1 or self._posted_any \
                or self._incoming[src] is not None:
            return False
        recv = posted[0]
        if not recv.data.flags.c_contiguous or not self._take(recv.data, src, recv.tag,
                                                              recv.dtype, 0):
            return False
        posted.clear()
        if recv.found is not None:
            recv.found(src)
        recv.on_done(None)
        return True

    def _take(self, data: np.ndarray, src: int, tag: int, dtype: np.dtype, spin_ns: int) -> bool:
        """The core's take of the next message from `src` into `data` (see _take_whole)."""
        pos = self._core.take(self._take_lanes[src], self._consumed[src], tag,
                              _DTYPE_CODE[dtype], data, spin_ns)
        if not pos:
            return False
        self._consumed[src] = pos
        self._arrivals += 1
        return True

    def receive_now(self, x: np.ndarray, src: int, tag: int, wait: bool = True) -> bool:
        """A receive's fast path: when nothing else is pending from `src` or queued to send,
        take the next message from `src` into `x` if it is the one expected; `wait`: spin a
        while for it first, without the GIL. False, with nothing changed, when it is not
        (then the caller posts the receive the general way, which also reports mismatches,
        deadlines and lost peers)."""
        core = self._core
        if core is None or self._posted[src] or self._posted_any \
                or self._unexpected[src] or self._incoming[src] is not None \
                or any(self._sendq):
            return False
        pos = core.take(self._take_lanes[src], self._consumed[src], tag,   # `_take`, inline
                        _DTYPE_CODE[x.dtype], x, self._spin_ns if wait else 0)
        if not pos:
            return False
        self._consumed[src] = pos
        self._arrivals += 1
        return True

    def _progress_receive(self, src: int) -> bool:
        if self._take_whole(src):
            return True
        ring = self._rings[src]
        available = self._ctl[src][_W_SENT + self.rank] - self._consumed[src]
        if available <= 0:
            return False
        pos = self._consumed[src]
        piece, published = self._piece, pos
        while available > 0:
            if pos - published >= piece:   # the sender may refill what was read meanwhile
                self._consumed[src] = published = pos
                self._own.words[self._layout.w_consumed + src] = pos
                self._bells[src].ring()
            msg = self._incoming[src]
            if msg is None:
                tag, nbytes, code, address = _HEADER_WORDS.unpack_from(ring, pos % ring.size)
                pos, available = pos + _HEADER, available - _HEADER
                self._arrivals += 1
                msg = self._incoming[src] = _Incoming(tag, nbytes, SUPPORTED_DTYPES[code],
                                                      self._arrivals, address)
                self._match(msg, src)
                if address:
                    self._direct_arrived(msg, src)
            n = min(available, msg.stream_bytes - msg.received, piece)
            a, b = msg.received, min(msg.received + n, msg.nbytes)
            if b > a and msg.sink is not None:
                msg.sink[a:b] = _ring_read(ring, pos, b - a)
            msg.received += n
            pos, available = pos + n, available - n
            if msg.received == msg.stream_bytes:
                self._incoming[src] = None
                if msg.target is not None:
                    self._deliver(msg, src)
        self._consumed[src] = pos
        self._own.words[self._layout.w_consumed + src] = pos
        self._bells[src].ring()
        return True

    def _direct_arrived(self, msg: _Incoming, src: int) -> None:
        """A direct message's header arrived. Matched (or refused): its data is read now,
        straight into the receive. Else it stays in its sender's memory, as MPI's rendezvous,
        until a receive claims it (`_claim`: then read straight into that receive, one copy)
        or this rank has waited _DEFER_S with it unclaimed (`progress`: then read into a
        buffer, so that a send completes whether or not its receive is ever posted)."""
        if msg.target is None and msg.error is None:
            msg.since = time.monotonic()
            self._deferred[src].append(msg)
        else:
            self._take_deferred(src, msg)

    def _take_deferred(self, src: int, upto: _Incoming | None = None) -> None:
        """Read the direct messages from `src` that wait in its memory, in the order they
        arrived (the sender counts this rank's reads), each into a buffer of its own; then
        `upto`, if given, into its own sink (its receive's array; none where refused)."""
        queue = self._deferred[src]
        while queue and queue[0] is not upto:
            msg = queue.popleft()
            msg.sink = np.empty(msg.nbytes, dtype=np.uint8)
            self._read_direct(msg, src)
        if upto is not None:
            if queue:
                queue.popleft()
            self._read_direct(upto, src)

    def _take_stale_deferred(self, now: float) -> None:
        """`progress`'s look, once per ms: read the deferred messages that no receive claimed
        within _DEFER_S into buffers, so that their senders' sends complete."""
        for src, queue in enumerate(self._deferred):
            if queue and now - queue[0].since >= _DEFER_S:
                self._take_deferred(src)

    def _discard_deferred(self) -> None:
        """Closing or failing: tell each sender that its unclaimed direct messages were read
        (their data discarded, as a buffered unclaimed message's is), so that its sends end."""
        for src, queue in enumerate(self._deferred):
            while queue:
                msg = queue.popleft()
                msg.sink = None
                self._read_direct(msg, src)

    def _read_direct(self, msg: _Incoming, src: int) -> None:
        """A direct message's data, read out of the sender's memory into `msg.sink` (the
        receive it matched, or a buffer until one is posted; nothing where it failed to match
        or is discarded), then the sender told, whatever happened, so that its send
        completes."""
        address, msg.address = msg.address, 0
        try:
            if msg.error is None and msg.sink is not None and msg.nbytes:
                pid = self._pids[src]
                try:
                    cross_memory.read(pid, address, msg.sink)
                except OSError as exc:
                    gone = not process_alive(pid) or self._ctl[src][_W_CLOSED]
                    msg.error = PeerLostError(
                        f"rank {self.rank}: a message of {format_bytes(msg.nbytes)} from rank "
                        f"{src} (pid {pid}) could not be read out of its memory"
                        + (f": rank {src} {self._gone(src)}" if gone else f" ({exc})"), src)
        finally:
            self._read[src] += 1
            self._own.words[self._layout.w_read + src] = self._read[src]
            self._bells[src].ring()

    def _match(self, msg: _Incoming, src: int) -> None:
        """Give the message whose header just arrived to the earliest posted receive it fits
        (from its sender, or from any rank), else keep it until one is posted."""
        queue = self._posted[src]
        mine = next((r for r in queue if r.tag == msg.tag), None)
        if self._posted_any:
            anyone = next((r for r in self._posted_any if r.tag == msg.tag), None)
            if anyone is not None and (mine is None or anyone.order < mine.order):
                mine, queue = anyone, self._posted_any
        if mine is None:   # a direct message's data stays in its sender until claimed
            msg.sink = None if msg.address else np.empty(msg.nbytes, dtype=np.uint8)
            self._unexpected[src].append(msg)
            return
        queue.remove(mine)
        msg.target = mine
        if mine.found is not None:
            mine.found(src)
        if mine.data.size == msg.nbytes and mine.dtype == msg.dtype:
            msg.sink = mine.data
        else:
            msg.error = self._mismatch(msg, mine, src)

    def _claim(self, msg: _Incoming, recv: _Recv, src: int) -> None:
        msg.target = recv
        if recv.found is not None:
            recv.found(src)
        if recv.data.size != msg.nbytes or recv.dtype != msg.dtype:
            msg.error = self._mismatch(msg, recv, src)
        elif msg.address:   # still in its sender's memory: read straight into the receive
            msg.sink = recv.data
        if msg.address:
            self._take_deferred(src, msg)
        if msg.received == msg.stream_bytes:
            self._deliver(msg, src)

    def _deliver(self, msg: _Incoming, src: int) -> None:
        recv = msg.target
        if msg.error is None and msg.sink is not recv.data:
            recv.data[:] = msg.sink
        recv.on_done(msg.error)

    def _mismatch(self, msg: _Incoming, recv: _Recv, src: int) -> InvalidArgumentError:
        theirs = f"{msg.dtype.name} x {msg.nbytes // msg.dtype.itemsize}"
        ours = f"{recv.dtype.name} x {recv.data.size // recv.dtype.itemsize}"
        return InvalidArgumentError(
            f"rank {self.rank}: {recv.record}: rank {src} sent {theirs} "
            f"({format_bytes(msg.nbytes)}) with tag {msg.tag}, but the receiving array is {ours}; "
            f"the message was discarded")

    # ---- teardown ----------------------------------------------------------------------------
    def revoke(self) -> None:
        if self._closed:
            return
        self._own.words[_W_CLOSED] = 1   # the peers' waits see it at their next peer check
        for j, bell in enumerate(self._bells):
            if j != self.rank:
                bell.ring()

    def close(self) -> None:
        if self._closed:
            return
        self._discard_deferred()
        self.revoke()
        self._closed = True
        self._steps.close()   # its addresses are of the mappings closed below
        self._bells, self._peer_bells, self._peer_ctl, self._typed = [], [], [], {}
        self._staging, self._rings, self._out_rings, self._ctl = [], [], [], []
        for seg in self._segments:
            seg.close()
        self._segments = []


def _ring_write(ring: np.ndarray, pos: int, data: np.ndarray) -> None:
    cap = ring.size
    off = pos % cap
    first = min(data.size, cap - off)
    ring[off:off + first] = data[:first]
    if first < data.size:
        ring[:data.size - first] = data[first:]


def _ring_read(ring: np.ndarray, pos: int, n: int) -> np.ndarray:
    cap = ring.size
    off = pos % cap
    if off + n <= cap:
        return ring[off:off + n]
    return np.concatenate((ring[off:], ring[:n - (cap - off)]))



WORLD = "w"  # the world communicator's segment name part; its creation reclaims dead segments


def segment_part(comm_name: str) -> str:
    """The part of its segments' names that names communicator `comm_name` of a job: WORLD
    for the world communicator."""
    return WORLD if comm_name == "world" else comm_name


def create(ctx: HostContext) -> SharedMemoryBackend:
    """The shm backend of a job's world communicator (or of one grown from a communicator)."""
    return SharedMemoryBackend(ctx.store, ctx.rank, ctx.size, job_id=ctx.job_id,
                               comm_name=segment_part(ctx.comm_name), timeout_s=ctx.timeout_s)


def status() -> str:
    """What `anyccl info` says of the shm backend here."""
    direct = "usable" if cross_memory.available() else "not usable"
    core = "built" if _shmcore is not None else "not built: Python path"
    return f"available (shared memory; cross-memory attach {direct}; compiled core {core})"
