"""Simulated hosts on one Linux machine, for tests and benchmarks that must cross a network.

`Cluster(n)` makes n "hosts": each is a network namespace with one veth link (eth0, address
10.77.0.<i+1>/24) on a bridge that lives in a namespace of its own, and a process tree with
its own hostname (UTS), /dev/shm (mount), System V IPC and PID namespaces. All four matter:
ranks on two "hosts" that shared /dev/shm or could see each other's processes would talk
through shared memory or process_vm_readv and never touch the network. Each host's /etc/hosts
names every host (h1, h2, ...) by its address, as a cluster's DNS would.

Traffic goes only between these namespaces (and their own loopback): no address outside them is
configured or routed. `run(i, argv)` starts a program on host i; `kill_host(i)` ends every
process of host i at once (its PID namespace dies with its first process); `cut(i)` takes host
i's link down; `shape(rate)` limits every link with `tc ... tbf` in both directions;
`link_bytes(i)` reads host i's veth counters. Everything is removed by `close()` (also at
interpreter exit), whatever happened.

Needs root and `ip`, `nsenter`, `unshare`, `tc` (iproute2, util-linux); `Cluster.unavailable()`
says why not where they are missing.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

_SETUP_S = 20.0    # the most any one setup command may take
_live: list[Cluster] = []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_SETUP_S,
                          check=check)


def _mpi_sessions() -> set[str]:
    """The session directories of Open MPI's daemons and ranks in /tmp (prted.<pid>,
    prte.<host>..., ompi.<pid>)."""
    try:
        names = os.listdir(tempfile.gettempdir())
    except OSError:
        return set()
    return {n for n in names if n.startswith(("prted.", "prte.", "ompi."))}


class Cluster:
    """n simulated hosts named h1..hn (see the module's docstring). Use as a context manager."""

    def __init__(self, hosts: int) -> None:
        if not 1 <= hosts <= 16:
            raise ValueError(f"hosts={hosts}: 1 to 16 simulated hosts")
        self.size = hosts
        tag = f"{os.getpid() % 100000}{len(_live)}"
        self.prefix = f"acl{tag}"
        self.names = [f"h{i + 1}" for i in range(hosts)]
        # every cluster has its own bridge, so two clusters may use the same addresses
        self.addresses = [f"10.77.0.{i + 1}" for i in range(hosts)]
        self._bridge_ns = f"{self.prefix}-br"
        self._host_ns = [f"{self.prefix}-{name}" for name in self.names]
        self._inits: list[subprocess.Popen | None] = [None] * hosts
        self._pids: list[int] = [0] * hosts
        self._dir = tempfile.mkdtemp(prefix="anyccl-simhosts-")
        self._children: list[subprocess.Popen] = []
        self._closed = False
        self._relay: _Relay | None = None
        self._sessions_before = _mpi_sessions()
        _live.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- what can run here -------------------------------------------------------------------
    @staticmethod
    def unavailable() -> str | None:
        """Why simulated hosts cannot be made on this machine, or None if they can."""
        if os.geteuid() != 0:
            return "simulated hosts need root (network, mount and PID namespaces)"
        for tool in ("ip", "nsenter", "unshare", "tc"):
            if shutil.which(tool) is None:
                return f"simulated hosts need `{tool}` (iproute2 / util-linux)"
        probe = f"aclprobe{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace here: {made.stderr.strip()}"
        try:
            veth = _ip("-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b",
                       check=False)
            if veth.returncode != 0:
                return f"cannot create a veth link here: {veth.stderr.strip()}"
        finally:
            _ip("netns", "del", probe, check=False)
        return None

    # ---- building ----------------------------------------------------------------------------
    def _build(self) -> None:
        _ip("netns", "add", self._bridge_ns)
        _ip("-n", self._bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self._bridge_ns, "link", "set", "br0", "up")
        hosts_file = os.path.join(self._dir, "hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n")
            for name, address in zip(self.names, self.addresses):
                f.write(f"{address} {name}\n")
        for i, ns in enumerate(self._host_ns):
            _ip("netns", "add", ns)
            _ip("link", "add", self._port(i), "netns", self._bridge_ns, "type", "veth",
                "peer", "name", "eth0", "netns", ns)
            _ip("-n", self._bridge_ns, "link", "set", self._port(i), "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._start_host(i, hosts_file)

    def _port(self, i: int) -> str:
        return f"p{self.prefix[3:]}x{i}"[:15]

    def _start_host(self, i: int, hosts_file: str) -> None:
        """Host i's first process: in its network namespace, with new UTS, mount, IPC and PID
        namespaces, its own hostname, /dev/shm and /etc/hosts; it then sleeps until killed."""
        script = (f"hostname {self.names[i]} && mount -t tmpfs -o size=4g,mode=1777 tmpfs "
                  f"/dev/shm && mount --bind {shlex.quote(hosts_file)} /etc/hosts && "
                  f"echo ready && exec sleep 1000000")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self._host_ns[i], "unshare", "--uts", "--mount", "--ipc",
             "--pid", "--fork", "--mount-proc", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._inits[i] = proc
        line = _read_line(proc, _SETUP_S)
        if line != "ready":
            raise RuntimeError(f"simulated host {self.names[i]} did not start: {line!r} "
                               f"{proc.stderr.read().decode() if proc.poll() is not None else ''}")
        self._pids[i] = _child_of(proc.pid)

    # ---- using -------------------------------------------------------------------------------
    def enter(self, i: int) -> list[str]:
        """The command prefix that runs a program on host i (as root, in its namespaces)."""
        return ["nsenter", "-t", str(self._pids[i]), "-n", "-u", "-m", "-i", "-p",
                f"--wd={os.getcwd()}"]

    def run(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None,
            **popen: object) -> subprocess.Popen:
        """Start `argv` on host i (stdout and stderr captured unless `popen` says otherwise)."""
        popen.setdefault("stdout", subprocess.PIPE)
        popen.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.Popen([*self.enter(i), *argv], env=env, text=True, **popen)
        self._children.append(proc)
        return proc

    def run_job(self, per_host: int, port: int, args: Sequence[str], env: dict[str, str],
                timeout_s: float) -> list[tuple[int, str]]:
        """`anyccl run -n per_host [args]` on every host as one job (host i its node i, h1
        serving the rendezvous on `port`); each launcher's exit code and output (`finish`)."""
        procs = [self.run(i, [sys.executable, "-m", "anyccl", "run", "-n", str(per_host),
                              "--nnodes", str(self.size), "--node-rank", str(i),
                              "--master-addr", "h1", "--master-port", str(port), *args],
                          env=env) for i in range(self.size)]
        return finish(procs, timeout_s)

    def check_output(self, i: int, argv: Sequence[str], timeout_s: float = 30.0) -> str:
        proc = self.run(i, argv)
        out, err = proc.communicate(timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{argv} on {self.names[i]} failed ({proc.returncode}): {err}")
        return out

    def ssh_stand_in(self) -> str:
        """A program that runs `ssh [options] HOST COMMAND` as ssh would, on the simulated host
        named HOST, for launchers that start remote processes with ssh (MPICH's `-launcher ssh
        -launcher-exec PATH`). A process on one host cannot enter another's PID namespace, so
        the stand-in hands its command and its stdin/stdout/stderr, over a Unix socket, to a
        relay thread of this process, which starts it there and answers its exit code."""
        if self._relay is None:
            self._relay = _Relay(os.path.join(self._dir, "relay.sock"),
                                 {**{name: i for i, name in enumerate(self.names)},
                                  **{a: i for i, a in enumerate(self.addresses)}}, self)
        path = os.path.join(self._dir, "ssh")
        with open(path, "w") as f:
            f.write(f"#!{sys.executable}\n" + _SSH_STAND_IN.replace("SOCKET",
                                                                   repr(self._relay.path)))
        os.chmod(path, 0o755)
        return path

    def shape(self, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
        """Limit every link to `rate` (tc tbf, e.g. "2gbit") in both directions."""
        for i, ns in enumerate(self._host_ns):
            for where, dev in ((ns, "eth0"), (self._bridge_ns, self._port(i))):
                subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev",
                                dev, "root", "tbf", "rate", rate, "burst", burst, "latency",
                                latency], check=True, capture_output=True, timeout=_SETUP_S)

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(bytes sent, bytes received) by host i's link since it was made."""
        shown = json.loads(_ip("-n", self._host_ns[i], "-s", "-j", "link", "show", "eth0")
                           .stdout)[0]
        stats = shown.get("stats64", shown.get("stats"))
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def cut(self, i: int) -> None:
        """Host i drops off the network: its link goes down (its processes live on)."""
        _ip("-n", self._bridge_ns, "link", "set", self._port(i), "down")

    def kill_host(self, i: int) -> None:
        """Host i dies: every process on it is killed at once."""
        if self._pids[i]:
            try:
                os.kill(self._pids[i], signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._inits[i] is not None:
            self._inits[i].wait(timeout=_SETUP_S)

    def end_processes(self) -> None:
        """Every process on every host is killed but the host's own first process (the hosts
        live on, their shared memory too)."""
        for init in self._pids:
            if not init:
                continue
            try:
                space = os.readlink(f"/proc/{init}/ns/pid")
            except OSError:
                continue
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) == init:
                    continue
                try:
                    if os.readlink(f"/proc/{entry}/ns/pid") == space:
                        os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    pass
        self._remove_mpi_sessions()

    def _remove_mpi_sessions(self) -> None:
        """Remove the session directories Open MPI's daemons and ranks made in the shared /tmp
        since this cluster began, which a killed one leaves: they are named by pid, and the
        pids of a new PID namespace repeat, so the next daemon of that pid would refuse to
        start ("a daemon failed to report back", exit status 213)."""
        for name in _mpi_sessions() - self._sessions_before:
            shutil.rmtree(os.path.join(tempfile.gettempdir(), name), ignore_errors=True)

    def shm_files(self, i: int) -> list[str]:
        """What lies in host i's /dev/shm now."""
        return sorted(self.check_output(i, ["ls", "-A", "/dev/shm"]).split())

    # ---- ending ------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every host's processes and remove the namespaces and links (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._relay is not None:
            self._relay.close()
        for proc in self._children:
            if proc.poll() is None:
                proc.kill()
        for i, init in enumerate(self._inits):
            if init is None:
                continue
            if self._pids[i]:
                try:
                    os.kill(self._pids[i], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if init.poll() is None:
                try:
                    os.killpg(init.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                init.wait(timeout=_SETUP_S)
            except subprocess.TimeoutExpired:
                pass
        for proc in self._children:
            try:
                proc.wait(timeout=_SETUP_S)
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self._host_ns, self._bridge_ns]:
            _ip("netns", "del", ns, check=False)
        self._remove_mpi_sessions()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self in _live:
            _live.remove(self)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def finish(procs: Sequence[subprocess.Popen], timeout_s: float,
           cluster: Cluster | None = None) -> list[tuple[int, str]]:
    """(exit code, stdout + stderr) of each of `procs` (started by `Cluster.run`), killing
    what outlives `timeout_s` from now (its output then says so): with `cluster`, every
    process on its hosts (what a launcher started there may hold the output open)."""
    deadline = time.monotonic() + timeout_s
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            if cluster is not None:
                cluster.end_processes()
            out, err = proc.communicate(timeout=_SETUP_S)
            err += f"\n(killed after {timeout_s} s)"
        results.append((proc.returncode, out + err))
    return results


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return f"(nothing within {timeout_s:g} s)"
    return proc.stdout.readline().decode().strip()


def _child_of(pid: int) -> int:
    """The one child process of `pid` (unshare's forked child: the host's PID 1)."""
    deadline = time.monotonic() + _SETUP_S
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = f.read().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise RuntimeError(f"process {pid} has no child")


class _Relay:
    """Serves the ssh stand-in: each connection brings (host, command, the stand-in's
    environment) and three file descriptors; the command runs on that host with them, and its
    exit code goes back. A stand-in that goes away (its launcher killed it) takes its command
    with it. (Unlike ssh, the environment of the launcher travels: the simulated hosts share
    one filesystem, and the launcher's PATH is where its programs are.)"""

    def __init__(self, path: str, hosts: dict[str, int], cluster: Cluster) -> None:
        import socket
        import threading

        self.path, self._hosts, self._cluster = path, hosts, cluster
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="simhosts-relay")
        self._thread.start()

    def _serve(self) -> None:
        import threading

        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: object) -> None:
        import socket

        assert isinstance(conn, socket.socket)
        with conn:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            host, command, env = json.loads(message)
            try:
                if host not in self._hosts or len(fds) != 3:
                    conn.sendall(b"255")
                    return
                proc = subprocess.Popen([*self._cluster.enter(self._hosts[host]), "sh", "-c",
                                         command], stdin=fds[0], stdout=fds[1], stderr=fds[2],
                                        env=env)
            finally:
                for fd in fds:
                    os.close(fd)
            self._cluster._children.append(proc)
            conn.settimeout(0.1)
            while proc.poll() is None:     # ends with the process, or when the stand-in goes
                try:
                    if conn.recv(1) == b"":
                        proc.kill()
                except TimeoutError:
                    pass
                except OSError:
                    proc.kill()
            try:
                conn.sendall(str(proc.returncode if proc.returncode >= 0
                                 else 128 - proc.returncode).encode())
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=5)


_SSH_STAND_IN = r'''
import json, os, socket, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):          # ssh options: -x, -q, -o X, -p N, ...
    option = args.pop(0)
    if option in ("-o", "-p", "-l", "-i", "-F", "-E") and args:
        args.pop(0)
if len(args) < 2:
    sys.exit(f"ssh stand-in: expected HOST COMMAND, got {sys.argv[1:]}")
host = args.pop(0).split("@")[-1]
relay = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
relay.connect(SOCKET)
socket.send_fds(relay, [json.dumps([host, " ".join(args), dict(os.environ)]).encode()],
                [0, 1, 2])
code = relay.recv(16)
sys.exit(int(code) if code else 255)
'''


@atexit.register
def _close_all() -> None:
    for cluster in list(_live):
        cluster.close()
