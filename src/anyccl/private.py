"""Files only this user's processes can read or replace: the job key of an unkeyed loopback
rendezvous, flight records, the launcher's "who failed" markers.

Everything lives in a directory of the user (``$XDG_RUNTIME_DIR/anyccl``, else
``<tmp>/anyccl-<uid>``), created 0700 and checked on every use: a directory that another user
created first, that is a symbolic link, or that others may write is refused, never used. Files
are written atomically (a new 0600 file, then renamed over the name: a symbolic link planted
under that name is replaced, never followed) and read with O_NOFOLLOW from a file this user owns.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile

from .errors import RendezvousError


def _checked(path: str) -> str:
    """`path` as a directory of this user that no one else can write or enter (created 0700 if
    missing); RendezvousError naming what is wrong otherwise."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise RendezvousError(f"cannot create the private directory {path}: {exc}") from None
    info = os.lstat(path)
    uid = os.geteuid()
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != uid:
        problem = f"belongs to uid {info.st_uid}, not to this user (uid {uid})"
    elif info.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}: other users may enter it"
    if problem:
        raise RendezvousError(
            f"refusing to use {path}: it {problem}. Another user may have created it to read or "
            f"replace this job's files; remove it, or point ANYCCL_FLIGHT_DIR / "
            f"XDG_RUNTIME_DIR at a directory of your own")
    return path


def user_directory() -> str:
    """This user's anyccl directory (0700, checked)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        try:
            info = os.stat(runtime)
            if info.st_uid == os.geteuid() and not info.st_mode & 0o077:
                return _checked(os.path.join(runtime, "anyccl"))
        except OSError:
            pass
    return _checked(os.path.join(tempfile.gettempdir(), f"anyccl-{os.geteuid()}"))


def job_directory(job_id: str, root: str | None = None) -> str:
    """The private directory of job `job_id`: under `root` (itself created and checked) if
    given, else under `user_directory()`."""
    base = _checked(root) if root else user_directory()
    return _checked(os.path.join(base, f"anyccl-{job_id}" if root else f"job-{job_id}"))


def write(path: str, data: bytes) -> None:
    """Replace `path` (in a checked directory) by a new 0600 file holding `data`, atomically."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read(path: str) -> bytes:
    """The contents of `path` if it is a regular file of this user (not a link); OSError
    otherwise (FileNotFoundError if absent)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise PermissionError(f"{path} is not a file of this user")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def remove_tree(path: str) -> None:
    """Delete a private directory and what it holds (links are removed, never followed)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
