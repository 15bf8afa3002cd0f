"""A doorbell: a wake-up signal that lives in shared memory, rung by any process, waited on by
its owner, blocking in the kernel rather than spinning.

On Linux it is a process-shared POSIX semaphore (``sem_init(pshared=1)``) placed inside the
owner's shared-memory segment, so it needs no file of its own and dies with the segment. Its
count is only a hint that something changed: waiters re-check their condition after every wake,
and drain stale rings before sleeping, so the count never grows without bound. Where unnamed
process-shared semaphores do not exist (macOS), waiting falls back to sleeping in short, growing
steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
import time

SEM_BYTES = 32  # sizeof(sem_t) on 64-bit glibc and musl; the slot reserved in a segment
_CLOCK_MONOTONIC = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    for fn in ("sem_init", "sem_post", "sem_trywait", "sem_timedwait", "sem_destroy"):
        getattr(libc, fn).restype = ctypes.c_int
    return libc


_libc = _load_libc()


def cores_available() -> int:
    """The cores this process may run on (its affinity mask, which taskset, cgroups' cpusets
    and launchers' binding narrow), else the machine's: where a host's ranks outnumber them,
    waits yield the core instead of spinning on it."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1
try:  # sem_post without ctypes' per-call cost, where the compiled core was built
    from ._shmcore import ring as _post
except ImportError:  # pragma: no cover - built without a C compiler
    _post = None
_has_clockwait = _libc is not None and hasattr(_libc, "sem_clockwait")


class Doorbell:
    """The doorbell at `address` (an address inside a shared mapping, SEM_BYTES long). A
    waiter polls without sleeping for `spin_s` first (set by its owner)."""

    spin_s = 0.0
    yields = False   # whether a waiter's polling yields the core at every look (set by its owner)

    def __init__(self, address: int, *, create: bool) -> None:
        self.address = address
        self._post = _post
        self._addr = ctypes.c_void_p(address)
        self.polling = _libc is None
        if create and not self.polling and _libc.sem_init(self._addr, 1, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sem_init failed: {os.strerror(err)}")
        self._ts = _Timespec()

    def ring(self) -> None:
        """Wake the owner if it sleeps (or make its next sleep return at once)."""
        if self.polling:
            return
        if self._post is not None:
            self._post(self.address)
        else:
            _libc.sem_post(self._addr)  # EOVERFLOW only means the owner will wake anyway

    def drain(self) -> None:
        """Forget rings that arrived while the owner was not sleeping."""
        if not self.polling:
            while _libc.sem_trywait(self._addr) == 0:
                pass

    def sleep(self, timeout_s: float) -> None:
        """Sleep until rung or `timeout_s` passes. May return early; callers re-check."""
        if timeout_s <= 0:
            return
        if self.polling:
            time.sleep(min(timeout_s, 0.001))
            return
        if _has_clockwait:
            now = time.clock_gettime(time.CLOCK_MONOTONIC) + timeout_s
            self._ts.tv_sec, frac = int(now), now - int(now)
            self._ts.tv_nsec = int(frac * 1e9)
            rc = _libc.sem_clockwait(self._addr, _CLOCK_MONOTONIC, ctypes.byref(self._ts))
        else:
            now = time.time() + timeout_s
            self._ts.tv_sec, self._ts.tv_nsec = int(now), int((now - int(now)) * 1e9)
            rc = _libc.sem_timedwait(self._addr, ctypes.byref(self._ts))
        if rc != 0:
            err = ctypes.get_errno()
            if err not in (errno.ETIMEDOUT, errno.EINTR, errno.EAGAIN):
                raise OSError(err, f"waiting on a doorbell failed: {os.strerror(err)}")


class PollingBell:
    """The doorbell of a transport that nobody can ring (a library that progresses only when
    polled: MPI, gloo): sleeping is a short nap, after which the engine polls again. A waiter
    polls without sleeping for `spin_s` first, yielding the core at every look if `yields`."""

    def __init__(self, spin_s: float = 0.0, nap_s: float = 1e-4, yields: bool = False) -> None:
        self.spin_s, self.nap_s, self.yields = spin_s, nap_s, yields

    def ring(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def sleep(self, timeout_s: float) -> None:
        time.sleep(min(timeout_s, self.nap_s))
