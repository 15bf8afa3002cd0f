"""A backend is a module plus one registration: the transport below lives in this test file
alone, registers itself with `anyccl.backends.registry`, and runs the whole collective suite,
point-to-point included, through `anyccl.init(backend="store")` in every rank. It moves bytes
through the job's rendezvous store (slow, and that is fine here): nothing else in anyccl knows
it exists, and `anyccl info` and `anyccl bench --compare` list it once registered."""

from __future__ import annotations

import time

import numpy as np
import pytest
from harness import run_ranks
from test_collectives import CHECKS, check_reductions_are_bit_identical_on_every_rank

import anyccl
from anyccl.backends import registry
from anyccl.backends.base import Backend, Completion
from anyccl.backends.doorbell import PollingBell
from anyccl.errors import TimeoutError
from anyccl.ops import ReduceOp, accumulate, finish
from anyccl.store import PrefixStore, Store
from anyccl.trace import OpRecord

SETUP = {"ANYCCL_TEST_SETUP": "test_backend_registry:register", "ANYCCL_BACKEND": "store"}


class StoreBackend(Backend):
    """Every collective is an exchange of bytes through the store, then local arithmetic in
    rank order (so every rank computes the same bits); messages are numbered keys."""

    name = "store"

    def __init__(self, store: Store, rank: int, size: int, timeout_s: float) -> None:
        self.store, self.rank, self.size, self.timeout_s = store, rank, size, timeout_s
        self.doorbell = PollingBell(nap_s=1e-3)   # nobody rings: the engine polls the store
        self._seq = 0
        self._sent: dict[tuple[int, int], int] = {}
        self._taken: dict[tuple[int, int], int] = {}
        self._pending: list[tuple[np.ndarray, str, Completion, OpRecord]] = []

    def _exchange(self, payload: bytes, record: OpRecord) -> list[bytes]:
        self._seq += 1
        self.store.set(f"c{self._seq}/{self.rank}", payload)
        wait = max(0.01, min(record.deadline, time.monotonic() + self.timeout_s)
                   - time.monotonic())
        return [payload if r == self.rank else self.store.get(f"c{self._seq}/{r}", wait)
                for r in range(self.size)]

    def _everyone(self, x: np.ndarray, record: OpRecord) -> list[np.ndarray]:
        return [np.frombuffer(b, x.dtype) for b in self._exchange(x.tobytes(), record)]

    def _reduced(self, arrays: list[np.ndarray], op: ReduceOp) -> np.ndarray:
        acc = arrays[0].copy()
        for a in arrays[1:]:
            accumulate(acc, a, op)
        finish(acc, op, len(arrays))
        return acc

    def all_reduce(self, x: np.ndarray, op: ReduceOp, record: OpRecord) -> None:
        x[...] = self._reduced(self._everyone(x, record), op)

    def reduce(self, x: np.ndarray, root: int, op: ReduceOp, record: OpRecord) -> None:
        result = self._reduced(self._everyone(x, record), op)
        if self.rank == root:
            x[...] = result

    def broadcast(self, x: np.ndarray, root: int, record: OpRecord) -> None:
        parts = self._exchange(x.tobytes() if self.rank == root else b"", record)
        x[...] = np.frombuffer(parts[root], x.dtype)

    def all_gather(self, outs: list[np.ndarray], x: np.ndarray, record: OpRecord) -> None:
        for out, part in zip(outs, self._everyone(x, record)):
            out[...] = part

    def gather(self, x: np.ndarray, outs: list[np.ndarray] | None, root: int,
               record: OpRecord) -> None:
        parts = self._everyone(x, record)
        if outs is not None:
            for out, part in zip(outs, parts):
                out[...] = part

    def scatter(self, out: np.ndarray, chunks: list[np.ndarray] | None, root: int,
                record: OpRecord) -> None:
        parts = self._exchange(b"".join(c.tobytes() for c in chunks) if chunks else b"", record)
        out[...] = np.frombuffer(parts[root], out.dtype)[self.rank * out.size:
                                                         (self.rank + 1) * out.size]

    def reduce_scatter(self, out: np.ndarray, inputs: list[np.ndarray], op: ReduceOp,
                       record: OpRecord) -> None:
        parts = self._exchange(b"".join(a.tobytes() for a in inputs), record)
        mine = [np.frombuffer(p, out.dtype)[self.rank * out.size:(self.rank + 1) * out.size]
                for p in parts]
        out[...] = self._reduced(mine, op)

    def all_to_all(self, outs: list[np.ndarray], inputs: list[np.ndarray],
                   record: OpRecord) -> None:
        parts = self._exchange(b"".join(a.tobytes() for a in inputs), record)
        n = outs[0].size if outs else 0
        for j, out in enumerate(outs):
            out[...] = np.frombuffer(parts[j], out.dtype)[self.rank * n:(self.rank + 1) * n]

    def barrier(self, record: OpRecord) -> None:
        self._exchange(b"", record)

    # ---- messages ----------------------------------------------------------------------------
    def post_send(self, x: np.ndarray, dst: int, tag: int, record: OpRecord,
                  on_done: Completion) -> None:
        n = self._sent[(dst, tag)] = self._sent.get((dst, tag), 0) + 1
        self.store.set(f"m{self.rank}>{dst}/{tag}/{n}", x.tobytes())
        on_done(None)

    def post_recv(self, x: np.ndarray, src: int, tag: int, record: OpRecord,
                  on_done: Completion) -> None:
        n = self._taken[(src, tag)] = self._taken.get((src, tag), 0) + 1
        self._pending.append((x, f"m{src}>{self.rank}/{tag}/{n}", on_done, record))

    def progress(self) -> None:
        still = []
        for x, key, on_done, record in self._pending:
            if self.store.check(key):
                x[...] = np.frombuffer(self.store.get(key, 1.0), x.dtype)
                on_done(None)
            elif time.monotonic() >= record.deadline:
                on_done(TimeoutError(f"rank {self.rank}: {record} timed out (store backend)"))
            else:
                still.append((x, key, on_done, record))
        self._pending = still

    def abort(self, error: BaseException) -> None:
        pending, self._pending = self._pending, []
        for _, _, on_done, _ in pending:
            on_done(error)

    def subgroup(self, ranks: list[int], name: str, timeout_s: float) -> Backend:
        return StoreBackend(PrefixStore(name, self.store), ranks.index(self.rank), len(ranks),
                            timeout_s)

    def close(self) -> None:
        pass


def register(name: str = "store", kind: type = StoreBackend, note: str = "") -> None:
    """The one registration (run in each rank before anyccl.init, by ANYCCL_TEST_SETUP)."""
    registry.register_host(registry.HostEntry(
        name, f"cpu (through the rendezvous store{note})",
        lambda ctx: kind(PrefixStore("store", ctx.store), ctx.rank, ctx.size, ctx.timeout_s),
        lambda: "available (a transport defined in a test file)"))


class HalfwayFailing(StoreBackend):
    """The store backend, but an all_reduce of 13 elements raises a plain ValueError after
    every rank's data has moved (as a NumPy error inside a kernel would)."""

    def all_reduce(self, x: np.ndarray, op: ReduceOp, record: OpRecord) -> None:
        everyone = self._everyone(x, record)
        if x.size == 13:
            raise ValueError("operands could not be broadcast together (inside the kernel)")
        x[...] = self._reduced(everyone, op)


def register_failing() -> None:
    register("store-failing", HalfwayFailing, "; fails halfway on 13 elements")


def backend_name(comm) -> str:
    return comm.backend


@pytest.mark.shm_only
@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_a_backend_registered_from_a_test_file_runs_the_collective_suite(check, world_size):
    assert run_ranks(backend_name, world_size, env=SETUP) == ["store"] * world_size
    assert all(run_ranks(check, world_size, env=SETUP))


@pytest.mark.shm_only
def test_the_registered_backend_keeps_reductions_bit_identical():
    results = run_ranks(check_reductions_are_bit_identical_on_every_rank, 3, 1000, "float32",
                        env=SETUP)
    assert all(digests == results[0][1] for _, digests in results)


def exchange_messages(comm) -> bool:
    peer = (comm.rank + 1) % comm.size
    source = (comm.rank - 1) % comm.size
    got = np.empty(5, np.int64)
    work = comm.irecv(got, source, tag=3)
    comm.send(np.full(5, comm.rank, np.int64), peer, tag=3)
    work.wait(timeout=30)
    sub = comm.split(color=comm.rank % 2)
    x = np.array([comm.rank + 1.0])
    sub.all_reduce(x)
    expected = sum(r + 1.0 for r in range(comm.size) if r % 2 == comm.rank % 2)
    return bool((got == source).all() and x[0] == expected)


@pytest.mark.shm_only
def test_the_registered_backend_serves_messages_and_sub_communicators():
    assert all(run_ranks(exchange_messages, 3, env=SETUP))


def test_every_table_lists_a_registered_backend(monkeypatch):
    from anyccl.bootstrap import parse_backend
    from anyccl.tools import info, peers

    monkeypatch.setattr(registry, "_HOST", dict(registry.host_backends()))
    register()
    assert parse_backend("store") == ("store", None)
    assert parse_backend("cpu:store,cuda:nccl") == ("store", "nccl")
    assert ("store", "cpu (through the rendezvous store)",
            "available (a transport defined in a test file)") in info.backends()
    assert "store" in peers.peers()


def fail_halfway_then_call_again(comm) -> tuple[str, str]:
    with pytest.raises(anyccl.UnsupportedError):   # refused before any byte moves
        comm.all_reduce(np.ones(4), "median")
    comm.all_reduce(np.ones(4))                          # ... so it stays usable
    assert comm.failure is None and not comm.closed
    with pytest.raises(ValueError, match="inside the kernel") as halfway:
        comm.all_reduce(np.ones(13))
    assert not isinstance(halfway.value, anyccl.AnycclError)
    assert comm.failure is halfway.value and not comm.closed   # broken, not closed
    with pytest.raises(anyccl.CommunicatorClosedError) as after:
        comm.all_reduce(np.ones(4))
    return str(after.value), type(after.value.__cause__).__name__


@pytest.mark.shm_only
def test_an_error_after_bytes_moved_breaks_the_communicator_whatever_its_type():
    """A refusal (before any byte moves) leaves the communicator usable; any other error inside
    an operation, a plain ValueError included, breaks it: the ranks may be out of step."""
    env = {"ANYCCL_TEST_SETUP": "test_backend_registry:register_failing",
           "ANYCCL_BACKEND": "store-failing"}
    for text, cause in run_ranks(fail_halfway_then_call_again, 2, env=env):
        assert "broke on an earlier error" in text and "inside the kernel" in text, text
        assert cause == "ValueError"

