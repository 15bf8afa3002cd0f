"""The rendezvous key/value store through which ranks find each other.

Two implementations of one small interface (`Store`): `TCPStore`, a client of a `StoreServer`
thread that the launcher (or rank 0) runs, and `FileStore`, a directory on a file system all ranks
see. `PrefixStore` gives sub-communicators a private key space.

The TCP server binds to loopback unless told another address. Every connection must answer an
HMAC-SHA256 challenge keyed by the job's secret before it may send a request; the secret itself
never crosses the wire. A client that fails or stalls the handshake is logged and dropped, and
cannot hold up the job: each connection has its own thread and a handshake deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from abc import ABC, abstractmethod
from pathlib import Path

from .errors import RendezvousError, TimeoutError

log = logging.getLogger("anyccl.store")

_SET, _GET, _ADD, _CHECK, _DELETE = b"S", b"G", b"A", b"C", b"D"
_OK, _MISSING, _BAD = b"\x00", b"\x01", b"\x02"
_HEADER = struct.Struct("!cIQ")  # op, key length, value length
_REPLY = struct.Struct("!cQ")
_HANDSHAKE_DEADLINE_S = 5.0
_PENDING_PER_PEER = 16     # connections one peer may hold before answering the challenge
_ACCEPT_RETRY_S = 0.05     # after a failed accept (e.g. no file descriptors left): try again
_MAX_KEY_BYTES = 4096
_MAX_VALUE_BYTES = 1 << 30
_DOMAIN = b"anyccl-store-v1"


def _mac(job_key: bytes, nonce: bytes) -> bytes:
    return hmac.new(job_key, _DOMAIN + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("store connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class Store(ABC):
    """A key/value store shared by all ranks of a job. Values are bytes."""

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, replacing any earlier value."""

    @abstractmethod
    def get(self, key: str, timeout_s: float) -> bytes:
        """Return the value of `key`, waiting until some rank sets it; TimeoutError after
        `timeout_s` seconds."""

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer under `key` (0 if absent); return the sum."""

    @abstractmethod
    def check(self, key: str) -> bool:
        """Whether `key` is set, without waiting."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key` if present."""

    def close(self) -> None:  # noqa: B027 - most stores hold nothing to release
        """Release the connection (the data stays with the server)."""

    def barrier(self, name: str, world_size: int, timeout_s: float) -> None:
        """Return once `world_size` callers have entered the barrier called `name`."""
        if self.add(f"{name}/arrived", 1) == world_size:
            self.set(f"{name}/open", b"1")
        self.get(f"{name}/open", timeout_s)


class PrefixStore(Store):
    """Keys of `inner`, all under `prefix/`: one private namespace per communicator."""

    def __init__(self, prefix: str, inner: Store) -> None:
        self.prefix, self.inner = prefix, inner

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(f"{self.prefix}/{key}", value)

    def get(self, key: str, timeout_s: float) -> bytes:
        return self.inner.get(f"{self.prefix}/{key}", timeout_s)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(f"{self.prefix}/{key}", amount)

    def check(self, key: str) -> bool:
        return self.inner.check(f"{self.prefix}/{key}")

    def delete(self, key: str) -> None:
        self.inner.delete(f"{self.prefix}/{key}")

    def close(self) -> None:
        self.inner.close()


def connection_of(store: Store) -> Store:
    """The store under every PrefixStore around `store`: the job's connection."""
    while isinstance(store, PrefixStore):
        store = store.inner
    return store


class StoreServer:
    """A TCP key/value server on a daemon thread; lives as long as its owner."""

    def __init__(self, job_key: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        self.job_key = job_key
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise RendezvousError(f"cannot start the rendezvous store on {host}:{port}: {exc}") \
                from exc
        self._sock.listen(128)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.refused = 0
        self.clients = 0        # connections open now (past the challenge)
        self.served = False     # whether any client ever connected
        self._closed = False
        self._pending: dict[object, int] = {}  # peer -> connections not yet authenticated
        self._thread = threading.Thread(target=self._accept_loop, name="anyccl-store", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept_loop(self) -> None:
        """Accept until closed. A failed accept (out of file descriptors, a connection reset
        before it was taken) is logged and retried, never the end of the store; a peer that
        already holds _PENDING_PER_PEER unanswered challenges is turned away at once."""
        warned = False
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                if not warned:
                    log.warning("anyccl store: accept failed (%s); retrying", exc)
                    warned = True
                time.sleep(_ACCEPT_RETRY_S)
                continue
            who = _peer_identity(peer)
            with self._cond:
                pending = self._pending.get(who, 0)
                if pending < _PENDING_PER_PEER:
                    self._pending[who] = pending + 1
            if pending >= _PENDING_PER_PEER:
                conn.close()
                self._refuse(peer, f"{pending} connections of this peer await the challenge")
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, peer, who), daemon=True,
                                 name="anyccl-store-conn").start()
            except RuntimeError:  # no thread to be had: turn this one away, keep serving
                self._authenticated(who)
                conn.close()

    def _authenticated(self, who: object) -> None:
        with self._cond:
            left = self._pending.get(who, 1) - 1
            if left > 0:
                self._pending[who] = left
            else:
                self._pending.pop(who, None)

    def _serve(self, conn: socket.socket, peer: tuple, who: object) -> None:
        with conn:
            try:
                if not self._challenge(conn, peer):
                    return
            finally:
                self._authenticated(who)
            conn.settimeout(None)
            with self._cond:
                self.clients += 1
                self.served = True
            try:
                while True:
                    op, klen, vlen = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                    if klen > _MAX_KEY_BYTES or vlen > _MAX_VALUE_BYTES:
                        return   # not a client of ours: drop it
                    raw_key = _recv_exact(conn, klen)
                    value = _recv_exact(conn, vlen) if vlen else b""
                    try:
                        status, reply = self._handle(op, raw_key.decode(), value)
                    except (ValueError, struct.error) as exc:  # a malformed request
                        status, reply = _BAD, f"{type(exc).__name__}: {exc}".encode()
                    conn.sendall(_REPLY.pack(status, len(reply)) + reply)
            except (OSError, ConnectionError):
                return
            finally:
                with self._cond:
                    self.clients -= 1

    def _challenge(self, conn: socket.socket, peer: tuple) -> bool:
        """Whether the peer answered the HMAC challenge with the job's key."""
        nonce = secrets.token_bytes(32)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(_HANDSHAKE_DEADLINE_S)
            conn.sendall(nonce)
            answer = _recv_exact(conn, 32)
        except (OSError, ConnectionError):
            self._refuse(peer, "no answer to the challenge")
            return False
        if not hmac.compare_digest(answer, _mac(self.job_key, nonce)):
            self._refuse(peer, "wrong job key")
            return False
        try:
            conn.sendall(_OK)
        except OSError:
            return False
        return True

    def _refuse(self, peer: tuple, why: str) -> None:
        self.refused += 1
        log.warning("anyccl store refused a connection from %s: %s", peer[0], why)

    def _handle(self, op: bytes, key: str, value: bytes) -> tuple[bytes, bytes]:
        with self._cond:
            if op == _SET:
                self._data[key] = value
                self._cond.notify_all()
                return _OK, b""
            if op == _GET:
                timeout_s = struct.unpack("!d", value)[0]
                if not self._cond.wait_for(lambda: key in self._data, timeout=timeout_s):
                    return _MISSING, b""
                return _OK, self._data[key]
            if op == _ADD:
                total = int(self._data.get(key, b"0")) + struct.unpack("!q", value)[0]
                self._data[key] = str(total).encode()
                self._cond.notify_all()
                return _OK, struct.pack("!q", total)
            if op == _CHECK:
                return (_OK if key in self._data else _MISSING), b""
            if op == _DELETE:
                self._data.pop(key, None)
                return _OK, b""
        return _MISSING, b""


def _peer_identity(peer: tuple) -> object:
    """Who a connection comes from, for the per-peer cap: on loopback (where every local user
    shares one address) the uid owning the peer's socket, from /proc/net/tcp; else its
    address."""
    host, port = peer[0], peer[1]
    if host not in ("127.0.0.1", "::1", "::ffff:127.0.0.1") and not host.startswith("127."):
        return host
    wanted = f":{port:04X} "
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if (fields[1] + " ").endswith(wanted) and len(fields) > 7:
                        return ("uid", int(fields[7]))
        except (OSError, StopIteration, ValueError):
            continue
    return host


_CLIENTS: weakref.WeakSet[TCPStore] = weakref.WeakSet()

# a store server answers at once: one silent this long (past what a get asked it to wait) is
# out of reach
_REPLY_S = 10.0


def client_sockets() -> set[int]:
    """The file descriptors of this process's connections to stores (to leave alone when the
    others are shut down at exit: gloo.py)."""
    return {c._sock.fileno() for c in list(_CLIENTS)} - {-1}


class TCPStore(Store):
    """Client of a StoreServer. Connects with retries until `timeout_s` (the server may start
    after the client)."""

    def __init__(self, host: str, port: int, job_key: bytes, timeout_s: float) -> None:
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._lost: str | None = None    # why the store cannot be used any more
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=timeout_s)
                break
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise RendezvousError(
                        f"cannot reach the rendezvous store at {host}:{port} within {timeout_s:g} s"
                        f" ({exc}); is rank 0 (or `anyccl run`) running there?") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _CLIENTS.add(self)
        try:
            nonce = _recv_exact(self._sock, 32)
        except (OSError, ConnectionError) as exc:   # turned away before the challenge
            self._sock.close()
            raise RendezvousError(
                f"the rendezvous store at {host}:{port} closed the connection before its "
                f"challenge ({exc}): it is overloaded, or is not an anyccl store") from exc
        try:
            self._sock.sendall(_mac(job_key, nonce))
            if _recv_exact(self._sock, 1) != _OK:
                raise ConnectionError("refused")
        except (OSError, ConnectionError) as exc:
            self._sock.close()
            raise RendezvousError(
                f"the rendezvous store at {host}:{port} refused this rank: the job key differs "
                f"(ANYCCL_JOB_KEY must be the same on every rank)") from exc

    def _request(self, op: bytes, key: str, value: bytes = b"",
                 wait_s: float = 0.0) -> tuple[bytes, bytes]:
        """Send one request and read its reply, within `wait_s` (what the server may wait
        itself: a get's timeout) + _REPLY_S; RendezvousError if the store is lost or silent
        (then every later request fails at once: the stream is out of step)."""
        kb = key.encode()
        with self._lock:
            if self._lost is not None:
                raise RendezvousError(self._lost)
            try:
                self._sock.settimeout(wait_s + _REPLY_S)
                self._sock.sendall(_HEADER.pack(op, len(kb), len(value)) + kb + value)
                status, n = _REPLY.unpack(_recv_exact(self._sock, _REPLY.size))
                reply = _recv_exact(self._sock, n) if n else b""
            except socket.timeout as exc:
                self._lost = (f"the rendezvous store at {self.host}:{self.port} did not answer "
                              f"within {wait_s + _REPLY_S:g} s: this host may be cut off from "
                              f"it, or the process hosting it is stuck")
                raise RendezvousError(self._lost) from exc
            except (OSError, ConnectionError) as exc:
                self._lost = (f"lost the rendezvous store at {self.host}:{self.port} ({exc}); "
                              f"the process hosting it (the launcher or rank 0) has probably "
                              f"exited")
                raise RendezvousError(self._lost) from exc
        if status == _BAD:
            raise RendezvousError(f"the rendezvous store at {self.host}:{self.port} refused a "
                                  f"request on key {key!r}: {reply.decode(errors='replace')}")
        return status, reply

    def set(self, key: str, value: bytes) -> None:
        self._request(_SET, key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        status, value = self._request(_GET, key, struct.pack("!d", timeout_s), timeout_s)
        if status != _OK:
            raise TimeoutError(f"rendezvous: key {key!r} was not set within {timeout_s:g} s; "
                               f"not every rank has started, or ranks disagree on world_size")
        return value

    def add(self, key: str, amount: int) -> int:
        return struct.unpack("!q", self._request(_ADD, key, struct.pack("!q", amount))[1])[0]

    def check(self, key: str) -> bool:
        return self._request(_CHECK, key)[0] == _OK

    def delete(self, key: str) -> None:
        self._request(_DELETE, key)

    def close(self) -> None:
        self._sock.close()


class FileStore(Store):
    """A store in a directory that every rank can reach (`init_method="file:///path"`).

    As with torch's file store, the path must not hold a previous job's state: the last rank to
    close removes it.
    """

    def __init__(self, path: str | os.PathLike, world_size: int | None = None) -> None:
        self.root = Path(path)
        self.world_size = world_size
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise RendezvousError(f"file store: cannot create directory {self.root}: {exc}") \
                from exc

    def _path(self, key: str) -> Path:
        return self.root / key.encode().hex()

    def set(self, key: str, value: bytes) -> None:
        tmp = self.root / f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.write_bytes(value)
        os.replace(tmp, self._path(key))

    def get(self, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        path = self._path(key)
        while True:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"file store {self.root}: key {key!r} was not set within "
                                       f"{timeout_s:g} s") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def add(self, key: str, amount: int) -> int:
        import fcntl

        with open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self._path(key)
            total = (int(path.read_bytes()) if path.exists() else 0) + amount
            self.set(key, str(total).encode())
            return total

    def check(self, key: str) -> bool:
        return self._path(key).exists()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def close(self) -> None:
        """The last of `world_size` ranks to close removes the directory."""
        if self.world_size and self.root.exists() and \
                self.add("__closed__", 1) == self.world_size:
            self.remove()

    def remove(self) -> None:
        """Delete the directory and everything in it."""
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)
