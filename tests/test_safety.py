"""Safe by default: no rank's mistake touches another process's memory or gives wrong numbers,
no other local user can enter a job, and no message is lost at exit.

Each test states one promise; the ones about other users run an unprivileged user (`nobody`)
against 127.0.0.1 where the suite runs as root, and skip with that reason elsewhere.
"""

from __future__ import annotations

import glob
import os
import random
import stat
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from harness import launch_job, run_ranks, suite_backend

import anyccl

GUARD = 64 << 10        # bytes of canary on each side of an array
CANARY = 0xA5
MIB = 1 << 20


# ---- sizes that disagree: refused on every rank, no byte outside either array touched -------
def _guarded(nbytes: int, dtype=np.float32, fill: float = 1.0):
    """An array of `nbytes` with GUARD canary bytes on each side: (array, buffer)."""
    raw = np.full(GUARD + nbytes + GUARD, CANARY, np.uint8)
    x = raw[GUARD:GUARD + nbytes].view(dtype)
    x[...] = fill
    return x, raw


def _intact(raw: np.ndarray) -> bool:
    return bool((raw[:GUARD] == CANARY).all() and (raw[-GUARD:] == CANARY).all())


# (collective, bytes on rank 0, bytes on the others): the large ones take the direct
# process-to-process copies, the small ones the staging path
SHAPES = [
    ("broadcast", 16 * MIB, 512 << 10),
    ("broadcast", 512 << 10, 16 * MIB),
    ("all_reduce", 4 * MIB, 3 * MIB),
    ("all_reduce", 4 * MIB, 64 << 10),
    ("all_reduce", 64, 32),
    ("reduce", 4 * MIB, 1 * MIB),
    ("all_gather", 1 * MIB, 512 << 10),
    ("gather", 1 * MIB, 512 << 10),
    ("gather", 256 << 10, 1 * MIB),
    ("scatter", 1 * MIB, 512 << 10),
    ("scatter", 512 << 10, 1 * MIB),
    ("reduce_scatter", 1 * MIB, 256 << 10),
    ("all_to_all", 1 * MIB, 512 << 10),
]


def check_sizes_disagree(comm, name, mine_root, mine_other):
    n, me = comm.size, comm.rank
    nbytes = mine_root if me == 0 else mine_other
    x, raw = _guarded(nbytes, fill=me + 1.0)
    pieces = [_guarded(nbytes, fill=-1.0) for _ in range(n)]
    outs = [p for p, _ in pieces]
    before = x.copy()
    try:
        if name == "broadcast":
            comm.broadcast(x, 0)
        elif name == "all_reduce":
            comm.all_reduce(x)
        elif name == "reduce":
            comm.reduce(x, 0)
        elif name == "all_gather":
            comm.all_gather(outs, x)
        elif name == "gather":
            comm.gather(x, outs if me == 0 else None, 0)
        elif name == "scatter":
            comm.scatter(x, outs if me == 0 else None, 0)
        elif name == "reduce_scatter":
            comm.reduce_scatter(x, outs)
        else:
            comm.all_to_all(outs, [p.copy() for p in outs])
    except anyccl.CollectiveMismatchError as exc:
        error = str(exc)
    else:
        error = None
    guards = _intact(raw) and all(_intact(r) for _, r in pieces)
    untouched = bool((x == before).all()) and all((o == -1.0).all() for o in outs)
    y = np.full(3, me + 1.0)
    comm.all_reduce(y)  # every rank raised at the same collective: they stay in step
    return error, guards, untouched, bool((y == n * (n + 1) / 2).all())


@pytest.mark.parametrize("name,root_bytes,other_bytes", SHAPES)
def test_sizes_that_disagree_are_refused_on_every_rank_before_any_byte_moves(
        name, root_bytes, other_bytes):
    for rank, (error, guards, untouched, usable) in enumerate(
            run_ranks(check_sizes_disagree, 2, name, root_bytes, other_bytes)):
        assert error is not None, f"rank {rank}: {name} with sizes that disagree was accepted"
        assert error.startswith(f"rank {rank}: "), error
        assert "disagree" in error and "no data moved" in error, error
        assert guards, f"rank {rank}: memory around the arrays was written"
        assert untouched, f"rank {rank}: the arrays changed though the call was refused"
        assert usable, f"rank {rank}: the next collective gave a wrong result"


MISMATCHES = {  # what gloo or MPICH refuse, and anyccl without debug mode
    "dtype": lambda c, x: c.all_reduce(x if c.rank == 0 else x.astype(np.int32)),
    "redop": lambda c, x: c.all_reduce(x, op="sum" if c.rank == 0 else "max"),
    "root": lambda c, x: c.broadcast(x, src=0 if c.rank == 0 else 1),
    "collective": lambda c, x: c.all_reduce(x) if c.rank == 0 else c.broadcast(x, 0),
    "count": lambda c, x: c.all_reduce(x if c.rank == 0 else x[:7]),
    "all_gather_sizes": lambda c, x: c.all_gather(np.empty(c.size * x[:c.rank + 4].size,
                                                           np.float32), x[:c.rank + 4]),
}


def check_mismatch_refused(comm, case):
    x = np.ones(8, np.float32)
    before = x.copy()
    try:
        MISMATCHES[case](comm, x)
    except anyccl.CollectiveMismatchError as exc:
        error = str(exc)
    else:
        error = None
    y = np.full(2, 1.0)
    comm.all_reduce(y)
    return error, bool((x == before).all()), bool((y == comm.size).all())


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatches_gloo_and_mpich_refuse_are_refused_by_default(case):
    for rank, (error, untouched, usable) in enumerate(
            run_ranks(check_mismatch_refused, 2, case)):
        assert error is not None and error.startswith(f"rank {rank}: "), (rank, error)
        assert untouched and usable, (rank, untouched, usable)


def test_the_mpi_check_can_be_turned_off_for_latency():
    if suite_backend() != "mpi":
        pytest.skip("a setting of the mpi backend")
    for error, _, usable in run_ranks(check_mismatch_refused, 2, "dtype",
                                      env={"ANYCCL_MPI_AGREE": "0"}):
        assert error is None and usable


def check_read_only_on_one_rank(comm):
    out = np.zeros(4 * comm.size)
    if comm.rank == 1:
        out.flags.writeable = False   # an output that cannot receive the result
    error = None
    try:
        comm.all_gather(out, np.full(4, 2.0 + comm.rank))
    except anyccl.AnycclError as exc:
        error = exc
    y = np.full(3, comm.rank + 1.0)
    comm.all_reduce(y)
    return type(error).__name__, str(error), y.tolist()


def test_a_rank_refusing_its_arguments_makes_every_rank_raise_and_the_next_sum_is_right():
    (kind0, text0, y0), (kind1, text1, y1) = run_ranks(check_read_only_on_one_rank, 2)
    assert kind1 == "InvalidArgumentError" and "read-only" in text1
    assert kind0 == "CollectiveMismatchError", text0
    assert "rank 1 refused its arguments to all_gather()" in text0 and "read-only" in text0
    assert y0 == y1 == [3.0, 3.0, 3.0]


def check_two_threads(comm):
    """Two threads per rank issue collectives of different sizes at once: they may pair up
    differently on different ranks, which must be refused, never corrupt memory."""
    results, lock = [], threading.Lock()

    def one(nbytes):
        x, raw = _guarded(nbytes, fill=1.0)
        try:
            comm.all_reduce(x)
            outcome = "ok" if (x == comm.size).all() else "wrong"
        except anyccl.CollectiveMismatchError:
            outcome = "refused"
        with lock:
            results.append((outcome, _intact(raw)))
    threads = [threading.Thread(target=one, args=(b,)) for b in (4 * MIB, 512 << 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    y = np.ones(2)
    comm.all_reduce(y)
    return results, bool((y == comm.size).all())


def test_two_threads_issuing_collectives_of_different_sizes_never_corrupt_memory():
    for _ in range(3):
        for results, usable in run_ranks(check_two_threads, 2):
            assert len(results) == 2 and usable
            assert all(guards for _, guards in results), results
            assert all(outcome in ("ok", "refused") for outcome, _ in results), results


# ---- a peer dying mid-transfer is a lost peer, never a raw OS error ----------------------
_KILL_PROGRAM = textwrap.dedent("""
    import os, sys, time, numpy as np, anyccl
    comm = anyccl.init(timeout=20)
    op = sys.argv[1]
    x = np.ones(({mib} << 20) // 4, np.float32)
    outs = [np.empty_like(x) for _ in range(comm.size)]
    print("ready", flush=True)
    try:
        for _ in range(10000):
            if op == "all_reduce":
                comm.all_reduce(x)
            elif op == "all_gather":
                comm.all_gather(outs, x)
            else:
                comm.broadcast(x, 1)
    except anyccl.PeerLostError as exc:
        print(f"LOST {{exc.lost_rank}}", flush=True)
        sys.exit(0)
    except BaseException as exc:
        print(f"RAW {{type(exc).__name__}}: {{exc}}", flush=True)
        sys.exit(0)
""")


@pytest.mark.shm_only
def test_a_peer_killed_at_any_point_of_a_large_transfer_is_a_lost_peer(tmp_path):
    """50 kills at random moments of large all_reduce / all_gather / broadcast."""
    import socket

    script = tmp_path / "victim.py"
    script.write_text(_KILL_PROGRAM.format(mib=8))
    rng = random.Random(29)
    outcomes = []
    env_base = {k: v for k, v in os.environ.items()
                if not k.startswith(("ANYCCL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    for attempt in range(50):
        op = ("all_reduce", "all_gather", "broadcast")[attempt % 3]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen(
            [sys.executable, str(script), op], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**env_base, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "ANYCCL_JOB_KEY": "ab" * 16})
            for r in range(2)]
        try:
            assert procs[0].stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.15))
            procs[1].kill()
            out, err = procs[0].communicate(timeout=30)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        outcomes.append((op, out.strip().splitlines()[-1:] or [err[-300:]]))
    raw = [o for o in outcomes if not o[1][0].startswith("LOST 1")]
    assert not raw, f"{len(raw)} of 50 kills ended otherwise: {raw[:5]}"


# ---- fork after init ----------------------------------------------------------------------
def check_fork_after_init(comm):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its inherited communicator refuses, and says why
        try:
            comm.all_reduce(np.ones(2))
            message = "accepted"
        except anyccl.CommunicatorClosedError as exc:
            message = str(exc)
        except BaseException as exc:  # noqa: BLE001
            message = f"{type(exc).__name__}: {exc}"
        os.write(write, message.encode()[:4000])
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        child = f.read().decode()
    x = np.full(4, comm.rank + 1.0)
    comm.all_reduce(x)
    return child, x.tolist()


@pytest.mark.shm_only
def test_a_child_forked_after_init_cannot_use_the_communicator_and_the_parent_goes_on():
    for rank, (child, x) in enumerate(run_ranks(check_fork_after_init, 2)):
        assert "was forked from it after init()" in child and f"rank {rank}" in child, child
        assert x == [3.0] * 4


_FORK_EXITS = textwrap.dedent("""
    import os, time, numpy as np, anyccl
    comm = anyccl.init()
    if comm.rank == 0:
        child = os.fork()
        if child == 0:
            raise SystemExit(0)   # a child that exits normally runs the parent's exit handlers
        os.waitpid(child, 0)
        time.sleep(0.6)   # rank 1 waits in the next collective meanwhile, checking its peers
    x = np.full(4, comm.rank + 1.0)
    for _ in range(20):
        comm.all_reduce(x); x[:] = comm.rank + 1.0
    comm.barrier()
    print("sum ok", flush=True)
""")


@pytest.mark.shm_only
def test_a_forked_child_exiting_does_not_close_its_parents_communicator(tmp_path):
    script = tmp_path / "fork_exit.py"
    script.write_text(_FORK_EXITS)
    proc, _ = launch_job(str(script), 2, timeout_s=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("sum ok") == 2


# ---- mpi: a send is delivered even when the sender exits right after it ------------------
_SEND_THEN_EXIT = textwrap.dedent("""
    import time, numpy as np, anyccl
    comm = anyccl.init()
    n = (16 << 20) // 4
    if comm.rank == 0:
        comm.send(np.arange(n, dtype=np.float32), 1)    # then exit at once
    else:
        time.sleep(1.0)
        x = np.empty(n, np.float32)
        comm.recv(x, 0)
        assert (x == np.arange(n, dtype=np.float32)).all()
        print("received", flush=True)
""")


def test_an_mpi_sender_that_exits_right_after_a_large_send_still_delivers_it(tmp_path):
    pytest.importorskip("mpi4py")
    import shutil

    if shutil.which("mpiexec") is None:
        pytest.skip("needs mpiexec")
    script = tmp_path / "send_exit.py"
    script.write_text(_SEND_THEN_EXIT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANYCCL_", "RANK",
                                                                    "WORLD_SIZE", "MASTER_"))}
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script)],
                          env={**env, "ANYCCL_BACKEND": "mpi"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "received" in proc.stdout, proc.stderr[-2000:]


# ---- the launcher names the rank that failed first ----------------------------------------
_EARLY_EXIT = textwrap.dedent("""
    import os, signal, sys, numpy as np, anyccl
    comm = anyccl.init(timeout=float(sys.argv[2]))
    if comm.rank == 1:
        if sys.argv[1] == "exit":
            sys.exit(0)
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.all_reduce(np.ones(4))
""")


@pytest.mark.shm_only
@pytest.mark.parametrize("how,blamed", [("exit", "exited early (code 0) while rank 0"),
                                        ("stop", "was stopped")])
def test_the_launcher_blames_the_rank_that_left_or_stopped(tmp_path, how, blamed):
    script = tmp_path / "early.py"
    script.write_text(_EARLY_EXIT)
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2", str(script), how,
                           "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"rank 1 failed first: it {blamed}" in proc.stderr, proc.stderr[-2000:]


# ---- private files: flight records, markers, the unkeyed job key -------------------------
def test_flight_records_refuse_a_directory_others_can_write_and_never_follow_links(tmp_path):
    from anyccl import private
    from anyccl.errors import RendezvousError
    from anyccl.trace import FlightRecorder, OpRecord, flight_directory

    root = tmp_path / "flights"
    root.mkdir(mode=0o700)
    suite_flight_dir = os.environ.get("ANYCCL_FLIGHT_DIR")
    os.environ["ANYCCL_FLIGHT_DIR"] = str(root)
    try:
        planted = root / "anyccl-job1"
        planted.mkdir()
        planted.chmod(0o777)   # what another user would have made first
        with pytest.raises(RendezvousError, match="other users may enter it"):
            flight_directory("job1")
        (root / "anyccl-job2").symlink_to(tmp_path)
        with pytest.raises(RendezvousError, match="symbolic link"):
            flight_directory("job2")
        directory = flight_directory("job3")
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        victim = tmp_path / "victim"
        victim.write_text("precious")
        victim.chmod(0o600)
        os.symlink(victim, os.path.join(directory, "flight-world-rank0.json"))
        recorder = FlightRecorder(0, "world")
        recorder.queued(OpRecord("all_reduce", 1, "float32 x 4"))
        path = recorder.dump(directory)
        assert victim.read_text() == "precious"
        assert not os.path.islink(path) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert b'"all_reduce"' in private.read(path)
    finally:
        os.environ.pop("ANYCCL_FLIGHT_DIR")
        if suite_flight_dir is not None:
            os.environ["ANYCCL_FLIGHT_DIR"] = suite_flight_dir


_DUMPS = textwrap.dedent("""
    import anyccl
    from anyccl.trace import flight_directory
    comm = anyccl.init()
    print(comm.flight_recorder.dump(flight_directory(comm.job_id)), flush=True)
""")


@pytest.mark.shm_only
def test_the_launcher_removes_a_successful_jobs_private_directory(tmp_path):
    script = tmp_path / "dumps.py"
    script.write_text(_DUMPS)
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2", str(script)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ANYCCL_FLIGHT_DIR": str(tmp_path / "f")})
    assert proc.returncode == 0, proc.stderr
    written = proc.stdout.split()
    assert len(written) == 2 and all(p.startswith(str(tmp_path / "f")) for p in written)
    assert not glob.glob(str(tmp_path / "f" / "anyccl-*"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.shm_only
def test_an_unkeyed_loopback_rendezvous_uses_a_random_key_only_this_user_can_read():
    from anyccl import bootstrap, private
    from anyccl.errors import RendezvousError
    from anyccl.store import TCPStore

    port = _free_port()
    server_side = bootstrap._tcp_store("127.0.0.1", port, 0, 5.0)
    try:
        key_file = glob.glob(f"{private.user_directory()}/store-127.0.0.1-{port}.key")
        assert len(key_file) == 1
        assert stat.S_IMODE(os.stat(key_file[0]).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(key_file[0])).st_mode) == 0o700
        with pytest.raises(RendezvousError, match="job key differs"):
            TCPStore("127.0.0.1", port, f"anyccl-unkeyed:{port}".encode(), 2.0)
        peer = bootstrap._tcp_store("127.0.0.1", port, 1, 5.0)   # a rank of the job
        peer.set("x", b"1")
        assert server_side.get("x", 1.0) == b"1"
        peer.close()
    finally:
        server_side.close()
        for server in bootstrap._servers:
            if server.port == port:
                server.close()


def test_a_malformed_store_request_fails_that_request_and_the_store_keeps_serving():
    from anyccl.errors import RendezvousError
    from anyccl.store import StoreServer, TCPStore

    server = StoreServer(b"k" * 32)
    try:
        client = TCPStore(server.host, server.port, b"k" * 32, 5.0)
        client.set("counter", b"not a number")
        with pytest.raises(RendezvousError, match="refused a request on key 'counter'"):
            client.add("counter", 1)
        client.set("counter", b"41")
        assert client.add("counter", 1) == 42
        second = TCPStore(server.host, server.port, b"k" * 32, 5.0)   # still accepting
        assert second.get("counter", 1.0) == b"42"
        client.close()
        second.close()
    finally:
        server.close()


# ---- what another local user can try (root runs `nobody` against 127.0.0.1) --------------
def _nobody_python() -> tuple[int, int, str]:
    """(uid, gid, a Python `nobody` can run), or skip."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a second, unprivileged local user")
    import pwd

    try:
        who = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")
    for exe in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            probe = subprocess.run([exe, "-c", "pass"], capture_output=True, cwd="/",
                                   preexec_fn=_become(who.pw_uid, who.pw_gid))
        except OSError:   # not even executable for that user
            continue
        if probe.returncode == 0:
            return who.pw_uid, who.pw_gid, exe
    pytest.skip("no Python that user 'nobody' may run")


def _become(uid: int, gid: int):
    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    return drop


def _as_nobody(source: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    uid, gid, exe = _nobody_python()
    return subprocess.run([exe, "-c", textwrap.dedent(source), *args],
                          preexec_fn=_become(uid, gid), capture_output=True, text=True,
                          timeout=timeout_s, cwd="/")


_NOBODY_READS_AND_KNOCKS = """
import glob, hashlib, hmac, os, socket, sys
port = int(sys.argv[1])
found = []
for path in glob.glob("/tmp/anyccl-*/store-*") + glob.glob("/run/user/*/anyccl/store-*"):
    try:
        open(path, "rb").read()
        found.append("read " + path)
    except OSError:
        pass
s = socket.create_connection(("127.0.0.1", port), timeout=5)
nonce = s.recv(32)
s.sendall(hmac.new(f"anyccl-unkeyed:{port}".encode(), b"anyccl-store-v1" + nonce,
                   hashlib.sha256).digest())
reply = s.recv(1)
print("ADMITTED" if reply == b"\\x00" else "refused", *found)
"""


@pytest.mark.shm_only
def test_another_local_user_can_neither_read_the_key_nor_pass_the_handshake():
    from anyccl import bootstrap

    _nobody_python()
    port = _free_port()
    store = bootstrap._tcp_store("127.0.0.1", port, 0, 5.0)
    try:
        proc = _as_nobody(_NOBODY_READS_AND_KNOCKS, str(port))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["refused"], proc.stdout
    finally:
        store.close()
        for server in bootstrap._servers:
            if server.port == port:
                server.close()


_NOBODY_PUBLISHES = """
import os, sys
fd = os.open("/dev/shm" + sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
os.fchmod(fd, 0o666)
os.ftruncate(fd, int(sys.argv[2]))
print("published")
"""


@pytest.mark.shm_only
def test_a_segment_another_user_published_under_a_jobs_name_is_never_mapped():
    from anyccl.backends import shm
    from anyccl.errors import RendezvousError

    name = f"/anyccl-poison{os.getpid()}-w-1-deadbeef"
    proc = _as_nobody(_NOBODY_PUBLISHES, name, "65536")
    assert proc.stdout.strip() == "published", proc.stderr
    try:
        with pytest.raises(RendezvousError, match="belongs to uid 65534 with mode 0666"):
            shm._Segment(name, 65536, create=False)
    finally:
        os.unlink("/dev/shm" + name)


_NOBODY_PLANTS = """
import os, sys
root, victim = sys.argv[1], sys.argv[2]
d = os.path.join(root, f"anyccl-{sys.argv[3]}")
os.mkdir(d, 0o777)
os.chmod(d, 0o777)
os.symlink(victim, os.path.join(d, "store-127.0.0.1-1.key"))
print("planted")
"""


@pytest.mark.shm_only
def test_a_private_directory_another_user_created_first_is_refused(monkeypatch):
    import shutil
    import tempfile

    from anyccl import private
    from anyccl.errors import RendezvousError

    _nobody_python()
    shared_tmp = tempfile.mkdtemp(prefix="anyccl-test-shared-", dir="/tmp")
    try:
        os.chmod(shared_tmp, 0o1777)   # a second /tmp that every user may write
        victim = os.path.join(shared_tmp, "victim")
        with open(victim, "w") as f:
            f.write("precious")
        os.chmod(victim, 0o600)
        proc = _as_nobody(_NOBODY_PLANTS, shared_tmp, victim, str(os.geteuid()))
        assert proc.stdout.strip() == "planted", proc.stderr
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        monkeypatch.setattr(tempfile, "tempdir", shared_tmp)
        with pytest.raises(RendezvousError, match="belongs to uid 65534"):
            private.user_directory()
        with open(victim) as f:
            assert f.read() == "precious"
    finally:
        shutil.rmtree(shared_tmp, ignore_errors=True)


_NOBODY_FLOODS = """
import socket, sys, time
port, count, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
held = []
for _ in range(count):
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
    except OSError:
        pass
print(len(held), flush=True)
time.sleep(hold)
"""

_STORE_WITH_FEW_FDS = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from anyccl.store import StoreServer
server = StoreServer(b"k" * 32)
print(server.port, flush=True)
time.sleep(float(sys.argv[1]))
"""


@pytest.mark.shm_only
def test_a_connection_flood_from_another_user_neither_ends_the_store_nor_locks_out_the_job():
    from anyccl.store import TCPStore

    _nobody_python()
    server = subprocess.Popen([sys.executable, "-c", _STORE_WITH_FEW_FDS, "30"],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        flood = subprocess.Popen([_nobody_python()[2], "-c", _NOBODY_FLOODS, str(port), "375",
                                  "4"], preexec_fn=_become(*_nobody_python()[:2]),
                                 stdout=subprocess.PIPE, text=True, cwd="/")
        assert int(flood.stdout.readline()) > 0
        started = time.monotonic()
        client = TCPStore("127.0.0.1", port, b"k" * 32, 10.0)   # during the flood
        client.set("during", b"1")
        assert client.get("during", 1.0) == b"1"
        assert time.monotonic() - started < 5.0
        flood.wait(timeout=30)
        again = TCPStore("127.0.0.1", port, b"k" * 32, 10.0)    # and after it
        assert again.get("during", 1.0) == b"1"
        client.close()
        again.close()
    finally:
        server.kill()
        server.wait()


def check_mpi_timeout_names_what_peers_do(comm):
    if comm.rank == 1:
        try:
            comm.recv(np.empty(8), 0)   # rank 0 never sends: both time out
        except anyccl.TimeoutError as exc:
            return str(exc)
    else:
        time.sleep(0.3)   # rank 1 is waiting (and has said so) by now
        try:
            comm.all_reduce(np.ones(4))
        except anyccl.TimeoutError as exc:
            return str(exc)
    return "no timeout"


def test_an_mpi_timeout_says_what_each_peer_is_doing():
    if suite_backend() != "mpi":
        pytest.skip("shm says it through shared memory: tests/test_reliability.py")
    text0, text1 = run_ranks(check_mpi_timeout_names_what_peers_do, 2,
                             env={"ANYCCL_TIMEOUT": "2"})
    assert "rank 1 is in recv(" in text0 and "waiting for its peer" in text0, text0
    assert "rank 0 is in all_reduce(" in text1 or "rank 0 has not said" in text1, text1


def check_signatures(comm):
    from anyccl import agreement
    from anyccl.ops import ReduceOp

    x = np.ones(8, np.float32)
    comm.all_reduce(x, op="max")
    comm.broadcast(x, 1)
    comm.barrier()
    records = comm.flight_recorder.records()[-3:]
    expected = agreement.word("all_reduce", np.dtype(np.float32), -1, ReduceOp.MAX)
    return [agreement.describe(*r.agree) for r in records], records[0].agree == (expected, 8)


def test_the_signature_a_collective_carries_names_what_the_rank_called():
    for texts, same_as_word in run_ranks(check_signatures, 2):
        assert texts == ["all_reduce float32 x 8, op=MAX", "broadcast float32 x 8, root=1",
                         "barrier"]
        assert same_as_word   # the communicator's inline encoding is agreement.word()'s


def test_a_refusal_is_told_only_for_host_arrays():
    from anyccl.buffers import lives_on_gpu

    class OnGpu:   # what a CUDA array library shows: device memory, no host pointer
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1 << 40, False),
                                    "version": 3}

    assert not lives_on_gpu((np.ones(3), [np.ones(2)], None, 3.0))
    assert lives_on_gpu((np.ones(3), [np.ones(2), OnGpu()]))
