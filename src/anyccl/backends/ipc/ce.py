"""all_reduce, reduce_scatter and all_gather of large arrays by the copy engines, in a ring:
each GPU's DMA engine only ever pushes to the next rank's ring area over NVLink, a small kernel
handles what arrived in local memory (reduces it, or copies it out), and flags in the ranks'
signal areas (raised by one-thread kernels) order the two across ranks.

Why a ring: a copy engine pushing to one fixed peer moves about 390 GB/s per H100 (4 x H100
NV18), more than SM stores (about 360) or NCCL's all_reduce (about 350 busbw); copy engines
pushing to several peers at once, or to each in turn, or pulling from them, move 100-325 GB/s
(benchmarks/lab/nvlink_patterns.py; the results page of the copy-engine ring). So every rank
pushes to rank r + 1 only, and (n - 1) / n of each array crosses each rank's link per pass, as
in NCCL's ring.

The data is `nranks` segments (one array cut in n for all_reduce; the n inputs of
reduce_scatter, the n outputs of all_gather), each cut into chunks. A collective is a `Ring`:
`steps` steps, the first `reduces` of them reducing (all_reduce: n - 1 reduce-scatter steps then
n - 1 all-gather steps; reduce_scatter: n - 1 reducing; all_gather: n - 1 copying). Step s of
chunk c: rank r pushes chunk c of segment (r - s - shift) mod n to rank r + 1's ring area, at
position u % positions (u = s * chunks + c, the use); rank r + 1 takes it: at a reducing step
the kernel `ce_step` writes its own input's chunk (+) the arrival to where the segment lives
(times `scale` at the last reducing step, where the segment is whole), at a copying step
`ce_copy` copies the arrival there. What rank r pushes at step s + 1 is what it took at step s
(reduce_scatter keeps every segment's partial result in its one output, so a take there waits
until the push that reads the same place has left). Per rank, the uses take turns in two push
streams (one copies while the other waits for or raises its flags), and the caller's stream
takes:

  push (P):   [use u >= positions: wait for taken[pos], which r + 1 raised when it took the use
              u - positions] after the step s - 1 of chunk c (an event), copy the chunk to
              r + 1's position; then clear taken[pos] and raise pushed[pos] at r + 1
  take (S):   wait for pushed[pos] (from r - 1); ce_step or ce_copy; clear pushed[pos] and
              raise taken[pos] at r - 1; record the chunk's event

S is the caller's stream; the P streams fork from it and join it again at the end, after
waiting for (and clearing) the taken flags of the last uses of every position, so that every
flag a call raises is cleared when it ends (a CUDA graph replays the same values; the next call
finds every position free). all_gather's copy of the rank's own piece runs on a side stream
that forks and joins the same way, beside the ring rather than ahead of its takes.

Flags are written by a one-thread kernel (`ce_flags`) and waited for by another (`ce_wait`),
or by cuStreamWaitValue32 (the backend's `ce_memop_wait`, set only by lab/ce_modes.py). Not
written by cuStreamWriteValue32: CUDA precedes it with a system-wide memory fence, which slows
the copies in flight on the other streams.

A flag is raised only after the one who waits on it cleared it: pushed[pos] is raised again
only by the push of use u + positions, which waited for taken[pos], raised after the take had
cleared pushed[pos]. Every rank queues its operations in the order push(u), take(u), an order
in which the whole could also run on one queue (each waits only for what other ranks queued
earlier in that order, or for its own push of the same use), so streams that share a hardware
queue cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ... import gpu, tuning
from .memory import CE_POSITIONS, TILE_BYTES, PeerMemory

# pushes take turns in two streams, so that one copies while the other waits for or raises
# its flags (one stream: 4 x H100, 1 GiB, 8 chunks a segment, 309 GB/s; 2 chunks 347)
PUSH_STREAMS = 2
# smaller chunks lose more to the per-chunk flags and launches than they pipeline (4 x H100:
# 16 MiB chunks 257 GB/s at 256 MiB, 32 MiB 327)
MIN_CHUNK_BYTES = 32 << 20
CHUNKS = tuning.TABLE["ipc.ce_chunks"].default  # chunks per segment where the slot allows


@dataclass(frozen=True)
class Plan:
    """How `count` elements in `nranks` segments of `seg` elements (the last may be shorter)
    are cut: chunks of `chunk` elements, `chunks` of them per segment, through `positions`
    chunk positions of the ring area."""

    count: int
    seg: int
    chunk: int
    chunks: int
    positions: int

    def extent(self, q: int, k: int) -> tuple[int, int]:
        """(first element within segment q, element count) of its chunk k; the count is 0
        where the data ends before it."""
        start = k * self.chunk
        end = min(min((k + 1) * self.chunk, self.seg), self.count - q * self.seg)
        return start, max(0, end - start)


def plan(count: int, itemsize: int, nranks: int, area_bytes: int, chunks: int = CHUNKS) -> Plan:
    """The cut of one array of `count` elements of `itemsize` bytes (all_reduce) into `nranks`
    segments of whole 16-byte packs (the last may be shorter)."""
    pack = 16 // itemsize
    per_rank = -(-count // nranks)  # ceiling divisions
    return cut(-(-per_rank // pack) * pack, count, itemsize, area_bytes, chunks)


def cut(seg: int, count: int, itemsize: int, area_bytes: int, chunks: int = CHUNKS) -> Plan:
    """The cut of `count` elements of `itemsize` bytes in segments of `seg` with a ring area of
    `area_bytes` (a multiple of 64 KiB, at least two of them): chunks of 1/`chunks` of a
    segment, at least MIN_CHUNK_BYTES, at most half the area (so at least two positions
    alternate), in 64 KiB steps."""
    want = max(MIN_CHUNK_BYTES, -(-seg * itemsize // chunks))
    chunk_bytes = min(-(-want // TILE_BYTES) * TILE_BYTES,
                      area_bytes // 2 // TILE_BYTES * TILE_BYTES)
    chunk = max(1, chunk_bytes // itemsize)
    return Plan(count, seg, chunk, max(1, -(-seg // chunk)),
                min(CE_POSITIONS, area_bytes // (chunk * itemsize)))


@dataclass(frozen=True)
class Ring:
    """One collective as the ring runs it on one rank: `steps` steps, of which the first
    `reduces` reduce (the arrival (+) `inputs[q]`, times `scale` at the last of them) and the
    rest copy. The chunk of segment q that step s pushes is read from `first[q]` (s = 0) or
    `segments[q]` (later steps); a take writes it to `segments[q]`. Pointers are of each
    segment's first element; `shift` turns which segment each rank pushes first."""

    plan: Plan
    itemsize: int
    steps: int
    reduces: int
    shift: int
    first: tuple[int, ...]
    segments: tuple[int, ...]
    inputs: tuple[int, ...]
    scale: float = 1.0
    own: tuple[int, int, int] | None = None   # (dst, src, bytes) copied beside the ring


def all_reduce(ptr: int, p: Plan, itemsize: int, nranks: int, scale: float) -> Ring:
    """The array at `ptr` reduced in place: n - 1 reducing steps, then n - 1 copying ones."""
    segs = tuple(ptr + q * p.seg * itemsize for q in range(nranks))
    return Ring(p, itemsize, 2 * (nranks - 1), nranks - 1, 0, segs, segs, segs, scale)


def reduce_scatter(out: int, inputs: list[int], p: Plan, itemsize: int, scale: float) -> Ring:
    """Rank r's `out` = the reduction of every rank's `inputs[r]`: n - 1 reducing steps, each
    segment's partial result kept in `out` (shift 1: rank r's last take is its own segment)."""
    n = len(inputs)
    return Ring(p, itemsize, n - 1, n - 1, 1, tuple(inputs), (out,) * n, tuple(inputs), scale)


def all_gather(outs: list[int], x: int, rank: int, p: Plan) -> Ring:
    """Every rank's `x` (`p.seg` bytes) into `outs[q]`: n - 1 copying steps, the first pushing
    `x` itself; this rank's own piece copied beside them (unless `x` is it: in place)."""
    n = len(outs)
    first = tuple(x if q == rank else outs[q] for q in range(n))
    own = (outs[rank], x, p.seg) if outs[rank] != x else None
    return Ring(p, 1, n - 1, 0, 0, first, tuple(outs), tuple(outs), own=own)


class Kernels(Protocol):
    """What `CopyEngineRing.enqueue` queues besides copies (the backend's kernels)."""

    def step(self, stream: int, inp: int, arrived: int, out: int, count: int,
             scale: float) -> None:
        """Queue `ce_step` on `count` elements: out = (inp (+) arrived) times `scale`."""

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        """Queue `ce_copy`: `nbytes` from `src` (arrived) to `dst` (local)."""

    def flags(self, stream: int, clear: list[int], raise_: list[int]) -> None:
        """Queue clearing the flags at `clear` (this rank's), then raising those at `raise_`
        to 1, after the stream's earlier work (made visible to the peers first)."""

    def wait(self, stream: int, flags: list[int]) -> None:
        """Make the stream's later work wait until every flag at `flags` is raised."""


class CopyEngineRing:
    """The streams and events of this rank's copy-engine collectives (made on first use)."""

    def __init__(self, memory: PeerMemory, device: int) -> None:
        self.memory = memory
        self.device = device
        self._made = False
        self.ready: list[int] = []
        self.sent: list[int] = []

    def _make(self) -> None:
        self.push = [gpu.new_stream(self.device) for _ in range(PUSH_STREAMS)]
        self.side = gpu.new_stream(self.device)   # a copy that nothing in the ring waits for
        self.fork, self.pushed = gpu.new_event(self.device), gpu.new_event(self.device)
        self._made = True

    def _events(self, chunks: int) -> None:
        """Two events per chunk of a segment, made as plans need more: `ready` (the chunk
        was taken) and `sent` (its push has left)."""
        while len(self.ready) < chunks:
            self.ready.append(gpu.new_event(self.device))
            self.sent.append(gpu.new_event(self.device))

    def enqueue(self, stream: int, job: Ring, kernels: Kernels) -> None:
        """Queue `job` on `stream`."""
        if not self._made:
            self._make()
        m, r, n, p, size = self.memory, self.memory.rank, self.memory.size, job.plan, job.itemsize
        nxt, prev = (r + 1) % n, (r - 1) % n
        self._events(p.chunks)
        ready, sent = self.ready, self.sent
        chunk_bytes = p.chunk * size
        gpu.record(self.fork, stream)
        joins = [*self.push, self.side] if job.own else self.push
        for push in joins:
            gpu.stream_wait(push, self.fork)
        if job.own:
            gpu.copy_async(*job.own, self.side)
        uses = job.steps * p.chunks
        for s in range(job.steps):
            for c in range(p.chunks):
                u = s * p.chunks + c
                pos, push = u % p.positions, self.push[u % PUSH_STREAMS]
                free = [m.taken_flag(r, pos, nxt)] if u >= p.positions else []
                if free:                          # r + 1 took what was here before
                    kernels.wait(push, free)
                if s:                             # what this rank took at step s - 1
                    gpu.stream_wait(push, ready[c])
                q = (r - s - job.shift) % n
                start, count = p.extent(q, c)
                source = (job.segments if s else job.first)[q] + start * size
                q = (r - 1 - s - job.shift) % n
                take, taking = p.extent(q, c)
                out = job.segments[q] + take * size
                if count:
                    gpu.copy_async(m.ce_ring(nxt) + pos * chunk_bytes, source, count * size,
                                   push)
                    if out == source and taking:  # the take below writes where this reads
                        gpu.record(sent[c], push)
                kernels.flags(push, free, [m.pushed_flag(nxt, pos, r)])
                arrived = [m.pushed_flag(r, pos, prev)]
                kernels.wait(stream, arrived)
                if taking:
                    arrival = m.ce_ring(r) + pos * chunk_bytes
                    if out == source and count:
                        gpu.stream_wait(stream, sent[c])
                    if s < job.reduces:
                        kernels.step(stream, job.inputs[q] + take * size, arrival, out, taking,
                                     job.scale if s == job.reduces - 1 else 1.0)
                    else:
                        kernels.copy(stream, out, arrival, taking * size)
                kernels.flags(stream, arrived, [m.taken_flag(prev, pos, r)])
                gpu.record(ready[c], stream)
        for push in joins[1:]:
            gpu.record(self.pushed, push)
            gpu.stream_wait(self.push[0], self.pushed)
        last = sorted({u % p.positions for u in range(max(0, uses - p.positions), uses)})
        for i in range(0, len(last), n):          # the last uses' taken flags, cleared
            free = [m.taken_flag(r, pos, nxt) for pos in last[i:i + n]]
            kernels.wait(self.push[0], free)
            kernels.flags(self.push[0], free, [])
        gpu.record(self.pushed, self.push[0])
        gpu.stream_wait(stream, self.pushed)

    def close(self) -> None:
        if not self._made:
            return
        for event in (self.fork, self.pushed, *self.ready, *self.sent):
            gpu.destroy_event(event)
        self.ready, self.sent = [], []
        for push in (*self.push, self.side):
            gpu.destroy_stream(push)
        self._made = False
