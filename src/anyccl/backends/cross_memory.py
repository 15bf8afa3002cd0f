"""Cross-memory attach: read another process's memory with one kernel copy
(``process_vm_readv``), as MPICH and Open MPI do for large intra-node messages.

It needs the same user and ptrace permission over the peer (Yama's ptrace_scope 0, or
capabilities; container seccomp profiles may refuse it), so the shm backend probes it once per
communicator and falls back to copying through shared memory when any rank cannot use it.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

from .. import settings


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load(name: str):
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, name, None)
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv, _writev = _load("process_vm_readv"), _load("process_vm_writev")


def available() -> bool:
    return _readv is not None and _writev is not None and settings.SHM_CMA.get()


def _transfer(call, what: str, pid: int, address: int, local_array: np.ndarray) -> None:
    total, done = local_array.nbytes, 0
    base = local_array.ctypes.data
    local, remote = _IOVec(), _IOVec()
    while done < total:
        local.base, local.len = base + done, total - done
        remote.base, remote.len = address + done, total - done
        n = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} with pid {pid}: {os.strerror(err)}")
        done += n


def read(pid: int, address: int, dst: np.ndarray) -> None:
    """Copy dst.nbytes bytes at `address` in process `pid` into contiguous `dst`."""
    _transfer(_readv, "process_vm_readv", pid, address, dst)


def write(pid: int, address: int, src: np.ndarray) -> None:
    """Copy contiguous `src` to `address` in process `pid`."""
    _transfer(_writev, "process_vm_writev", pid, address, src)
