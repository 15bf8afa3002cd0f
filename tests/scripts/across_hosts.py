"""One rank of a job across (simulated) hosts; the many-hosts tests start it with every launcher.

    python across_hosts.py MODE

MODE:
  suite     every collective (several dtypes, sizes on both sides of the hierarchical paths,
            sizes that do not divide by the ranks per host), uneven forms, point-to-point with
            tags and from any source, async works with deadlines, split, object collectives,
            checked against NumPy; prints "rank R ok BACKEND" at the end.
  mismatch  the ranks of the last host call all_reduce with another count: every rank must
            raise CollectiveMismatchError (prints "rank R refused: ..."), then the job goes on.
  loop      all_reduce in a loop until something fails (the fault tests kill or cut a host);
            prints "rank R failed: TYPE: MESSAGE" and exits 3.
  raise     the last rank raises ValueError after one collective; the others wait in the next.
"""

import socket
import sys
import time

import numpy as np

import anyccl

MODE = sys.argv[1] if len(sys.argv) > 1 else "suite"
comm = anyccl.init()
r, n = comm.rank, comm.size
rng = np.random.default_rng(1234)


def every_rank(shape, dtype, salt=0):
    """The input of every rank, the same on every rank's view of it."""
    return [(np.random.default_rng(1000 * q + salt).integers(-8, 9, shape)).astype(dtype)
            for q in range(n)]


def suite() -> None:
    for count in (1, 7, 1000, 65536 + 3, 1 << 18):
        for dtype in (np.float32, np.float64, np.int64, np.int16, np.uint8):
            inputs = every_rank(count, dtype, count)
            for op, ref in (("sum", lambda a: np.sum(a, axis=0)),
                            ("max", lambda a: np.max(a, axis=0)),
                            ("min", lambda a: np.min(a, axis=0))):
                if dtype == np.uint8 and op == "sum":
                    continue
                x = inputs[r].copy()
                comm.all_reduce(x, op=op)
                expected = ref(np.stack(inputs)).astype(dtype)
                assert np.array_equal(x, expected), ("all_reduce", count, dtype, op)
        x = every_rank(count, np.float32, 5)[r].copy()
        comm.all_reduce(x, op="avg")
        assert np.allclose(x, np.mean(np.stack(every_rank(count, np.float32, 5)), axis=0)), \
            ("avg", count)
        for root in {0, n - 1, n // 2}:
            x = np.arange(count, dtype=np.float64) * (r + 1)
            comm.broadcast(x, root)
            assert np.array_equal(x, np.arange(count, dtype=np.float64) * (root + 1))
            x = every_rank(count, np.int64, 7)[r].copy()
            before = x.copy()
            comm.reduce(x, root, op="sum")
            if r == root:
                assert np.array_equal(x, np.sum(np.stack(every_rank(count, np.int64, 7)), 0))
            else:
                assert np.array_equal(x, before), "reduce changed a non-root's input"
        outs = [np.empty(count, np.int32) for _ in range(n)]
        comm.all_gather(outs, np.full(count, r, np.int32))
        assert all(np.array_equal(o, np.full(count, q)) for q, o in enumerate(outs))
        flat = np.empty(n * count, np.float32)
        comm.all_gather(flat, np.full(count, r + 0.5, np.float32))
        assert np.array_equal(flat, np.repeat(np.arange(n) + 0.5, count).astype(np.float32))
        out = np.empty(count, np.float64)
        comm.reduce_scatter(out, [np.full(count, 100.0 * r + j) for j in range(n)])
        assert np.array_equal(out, np.full(count, sum(100.0 * q + r for q in range(n))))
    # uneven forms: a size per rank
    mine = np.full(r + 1, r, np.int64)
    outs = [np.empty(q + 1, np.int64) for q in range(n)]
    comm.all_gather(outs, mine)
    assert all(np.array_equal(o, np.full(q + 1, q)) for q, o in enumerate(outs))
    got = [np.empty(q + 1, np.int64) for q in range(n)] if r == 0 else None
    comm.gather(mine, got, 0, uneven=True)
    if r == 0:
        assert all(np.array_equal(o, np.full(q + 1, q)) for q, o in enumerate(got))
    piece = np.empty(r + 2, np.float32)
    chunks = [np.full(q + 2, 7.0 * q, np.float32) for q in range(n)] if r == n - 1 else None
    comm.scatter(piece, chunks, n - 1, uneven=True)
    assert np.array_equal(piece, np.full(r + 2, 7.0 * r))
    sends = [(r + j) % 3 + 1 for j in range(n)]
    receives = [(j + r) % 3 + 1 for j in range(n)]
    data = np.concatenate([np.full(c, 10 * r + j, np.int32) for j, c in enumerate(sends)])
    back = np.empty(sum(receives), np.int32)
    comm.all_to_all(back, data, out_splits=receives, in_splits=sends)
    assert np.array_equal(back, np.concatenate([np.full(c, 10 * j + r) for j, c in
                                                enumerate(receives)]))
    # even gather / scatter / all_to_all
    got = [np.empty(3, np.float64) for _ in range(n)] if r == 1 else None
    comm.gather(np.full(3, r * 1.5), got, 1)
    if r == 1:
        assert all(np.array_equal(o, np.full(3, q * 1.5)) for q, o in enumerate(got))
    out = np.empty(4, np.int16)
    comm.scatter(out, [np.full(4, q, np.int16) for q in range(n)] if r == 0 else None, 0)
    assert np.array_equal(out, np.full(4, r))
    outs = [np.empty(2, np.int64) for _ in range(n)]
    comm.all_to_all(outs, [np.full(2, 100 * r + j, np.int64) for j in range(n)])
    assert all(np.array_equal(o, np.full(2, 100 * q + r)) for q, o in enumerate(outs))
    # point to point: a ring with tags, both directions, then any-source at rank 0
    right, left = (r + 1) % n, (r - 1) % n
    for tag in (0, 9):
        box = np.empty(5, np.float32)
        work = comm.irecv(box, left, tag=tag)
        comm.send(np.full(5, 10 * r + tag, np.float32), right, tag=tag)
        assert work.wait(timeout=60)
        assert np.array_equal(box, np.full(5, 10 * left + tag))
    if r == 0:
        heard = sorted(int(comm.recv(np.empty(2, np.int64), None, tag=4)) for _ in range(n - 1))
        assert heard == list(range(1, n)), heard
    else:
        comm.send(np.full(2, r, np.int64), 0, tag=4)
    # async collectives, completed in order, with deadlines
    works = [comm.all_reduce(np.full(64, float(q)), async_op=True) for q in range(3)]
    assert all(w.wait(timeout=60) for w in works)
    # sub-communicators: within a host, across hosts, by parity
    host_number = sorted(set(comm.hosts)).index(comm.hosts[r])
    for color in (host_number, r % 2, r // 2):
        sub = comm.split(color)
        z = np.full(1000, sub.rank + 1.0)
        sub.all_reduce(z)
        assert np.array_equal(z, np.full(1000, sub.size * (sub.size + 1) / 2)), color
        sub.close()
    objects = comm.all_gather_object({"rank": r, "host": socket.gethostname()})
    assert [o["rank"] for o in objects] == list(range(n))
    assert [o["host"] for o in objects] == list(comm.hosts)
    box = [f"from {r}"]
    assert comm.broadcast_object(box, n - 1) == [f"from {n - 1}"]
    comm.barrier()
    print(f"rank {r} ok {comm.backend} on {socket.gethostname()}", flush=True)


def mismatch() -> None:
    last_host = comm.hosts[-1]
    count = 12 if comm.hosts[r] == last_host else 10
    try:
        comm.all_reduce(np.ones(count, np.float32))
    except anyccl.CollectiveMismatchError as exc:
        print(f"rank {r} refused: {str(exc).splitlines()[0]}", flush=True)
    else:
        print(f"rank {r} NOT refused", flush=True)
        sys.exit(4)
    x = np.ones(10, np.float32)
    comm.all_reduce(x)
    assert np.array_equal(x, np.full(10, float(n)))
    print(f"rank {r} ok after the mismatch", flush=True)


def loop() -> None:
    x = np.ones(1 << 16, np.float32)
    started = time.monotonic()
    try:
        for i in range(100000):
            comm.all_reduce(x)
            x[:] = 1
            if i == 20:
                print(f"rank {r} running", flush=True)
    except anyccl.AnycclError as exc:
        print(f"rank {r} failed after {time.monotonic() - started:.1f} s: "
              f"{type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
        sys.exit(3)


def raising() -> None:
    comm.barrier()
    if r == n - 1:
        raise ValueError(f"rank {r} gives up")
    comm.all_reduce(np.ones(8))


{"suite": suite, "mismatch": mismatch, "loop": loop, "raise": raising}[MODE]()
comm.close()
