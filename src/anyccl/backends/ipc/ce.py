"""all_reduce for large arrays by the copy engines, in a ring: each GPU's DMA engine only ever
pushes to the next rank's ring area over NVLink, a small kernel handles what arrived in local
memory, and flags in the ranks' signal areas (raised by one-thread kernels) order the two
across ranks.

Why a ring: a copy engine pushing to one fixed peer moves about 390 GB/s per H100 (4 x H100
NV18), more than SM stores (about 360) or NCCL's all_reduce (about 350 busbw); copy engines
pushing to several peers at once, or to each in turn, or pulling from them, move 100-325 GB/s
(benchmarks/lab/nvlink_patterns.py; the results page of the copy-engine ring). So every rank
pushes to rank r + 1 only, and 2 (n - 1) / n of the array crosses each rank's link, as in
NCCL's ring.

The array is cut into `nranks` segments, each into chunks. Step t (0 <= t < 2 (n - 1)) of chunk
c: rank r pushes chunk c of segment (r - t) mod n of its array to rank r + 1's ring area, at
position u % positions (u = t * chunks + c, the use); rank r + 1 takes it with the kernel
`ce_step`: at the reduce-scatter steps (t < n - 1) it reduces it into its own array (times
`scale` at the last of them, where the segment is whole), at the all-gather steps it copies it
there. What rank r pushes at step t + 1 is what it took at step t. Per rank, the uses take
turns in two push streams (one copies while the other waits for or raises its flags), and the
caller's stream takes:

  push (P):   [use u >= positions: wait for taken[pos], which r + 1 raised when it took the use
              u - positions] after the step t - 1 of chunk c (an event), copy the chunk to
              r + 1's position; then clear taken[pos] and raise pushed[pos] at r + 1
  take (S):   wait for pushed[pos] (from r - 1); ce_step; clear pushed[pos] and raise
              taken[pos] at r - 1; record the chunk's event

S is the caller's stream; the P streams fork from it and join it again at the end, after
waiting for (and clearing) the taken flags of the last uses of every position, so that every
flag a call raises is cleared when it ends (a CUDA graph replays the same values; the next call
finds every position free).

Flags are written by a one-thread kernel (`ce_flags`) and waited for by another (`ce_wait`),
or by cuStreamWaitValue32 (the backend's `ce_memop_wait`, set only by lab/ce_modes.py). Not
written by cuStreamWriteValue32: CUDA precedes it with a system-wide memory fence, which slows
the copies in flight on the other streams.

A flag is raised only after the one who waits on it cleared it: pushed[pos] is raised again
only by the push of use u + positions, which waited for taken[pos], raised after the take had
cleared pushed[pos]. Every rank queues its operations in the order push(u), take(u), an order
in which the whole could also run on one queue (each waits only for what other ranks queued
earlier in that order), so streams that share a hardware queue cannot deadlock.
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
    """How one all_reduce of `count` elements is cut: `seg` elements per rank's segment (a
    whole number of 16-byte packs), chunks of `chunk` elements, `chunks` of them per segment,
    through `positions` chunk positions of the ring area."""

    count: int
    seg: int
    chunk: int
    chunks: int
    positions: int

    def extent(self, q: int, k: int) -> tuple[int, int]:
        """(first element, element count) of chunk k of rank q's segment; the count is 0 where
        the array ends before it."""
        start = q * self.seg + k * self.chunk
        end = min(q * self.seg + min((k + 1) * self.chunk, self.seg), self.count)
        return start, max(0, end - start)


def plan(count: int, itemsize: int, nranks: int, area_bytes: int, chunks: int = CHUNKS) -> Plan:
    """The cut for `count` elements of `itemsize` bytes over `nranks` ranks with a ring area of
    `area_bytes` (a multiple of 64 KiB, at least two of them): chunks of 1/`chunks` of a
    segment, at least MIN_CHUNK_BYTES, at most half the area (so at least two positions
    alternate), in 64 KiB steps."""
    pack = 16 // itemsize
    per_rank = -(-count // nranks)  # ceiling divisions
    seg = -(-per_rank // pack) * pack
    want = max(MIN_CHUNK_BYTES, -(-seg * itemsize // chunks))
    chunk_bytes = min(-(-want // TILE_BYTES) * TILE_BYTES,
                      area_bytes // 2 // TILE_BYTES * TILE_BYTES)
    chunk = chunk_bytes // itemsize
    return Plan(count, seg, chunk, -(-seg // chunk),
                min(CE_POSITIONS, area_bytes // chunk_bytes))


class Kernels(Protocol):
    """What `CopyEngineAllReduce.enqueue` queues besides copies (the backend's kernels)."""

    def step(self, stream: int, inp: int, arrived: int, out: int, count: int,
             scale: float) -> None:
        """Queue `ce_step` on `count` elements: out = inp (+) arrived, times `scale`; or, where
        `inp` is 0, out = arrived."""

    def flags(self, stream: int, clear: list[int], raise_: list[int]) -> None:
        """Queue clearing the flags at `clear` (this rank's), then raising those at `raise_`
        to 1, after the stream's earlier work (made visible to the peers first)."""

    def wait(self, stream: int, flags: list[int]) -> None:
        """Make the stream's later work wait until every flag at `flags` is raised."""


class CopyEngineAllReduce:
    """The streams and events of this rank's copy-engine all_reduces (made on first use)."""

    def __init__(self, memory: PeerMemory, device: int) -> None:
        self.memory = memory
        self.device = device
        self._made = False
        self.ready: list[int] = []

    def _make(self) -> None:
        self.push = [gpu.new_stream(self.device) for _ in range(PUSH_STREAMS)]
        self.fork, self.pushed = gpu.new_event(self.device), gpu.new_event(self.device)
        self._made = True

    def _ready(self, chunks: int) -> list[int]:
        """An event per chunk of a segment (made as plans need more)."""
        while len(self.ready) < chunks:
            self.ready.append(gpu.new_event(self.device))
        return self.ready

    def enqueue(self, stream: int, ptr: int, p: Plan, itemsize: int, scale: float,
                kernels: Kernels) -> None:
        """Queue the all_reduce of the `p.count` elements at `ptr` on `stream` (the result
        times `scale`)."""
        if not self._made:
            self._make()
        m, r, n = self.memory, self.memory.rank, self.memory.size
        nxt, prev = (r + 1) % n, (r - 1) % n
        ready = self._ready(p.chunks)
        chunk_bytes = p.chunk * itemsize
        gpu.record(self.fork, stream)
        for push in self.push:
            gpu.stream_wait(push, self.fork)
        uses = 2 * (n - 1) * p.chunks
        for t in range(2 * (n - 1)):
            for c in range(p.chunks):
                u = t * p.chunks + c
                pos, push = u % p.positions, self.push[u % PUSH_STREAMS]
                free = [m.taken_flag(r, pos, nxt)] if u >= p.positions else []
                if free:                          # r + 1 took what was here before
                    kernels.wait(push, free)
                if t:                             # what this rank took at step t - 1
                    gpu.stream_wait(push, ready[c])
                start, count = p.extent((r - t) % n, c)
                if count:
                    gpu.copy_async(m.ce_ring(nxt) + pos * chunk_bytes, ptr + start * itemsize,
                                   count * itemsize, push)
                kernels.flags(push, free, [m.pushed_flag(nxt, pos, r)])
                arrived = [m.pushed_flag(r, pos, prev)]
                kernels.wait(stream, arrived)
                start, count = p.extent((r - 1 - t) % n, c)
                if count:
                    out = ptr + start * itemsize
                    kernels.step(stream, out if t < n - 1 else 0, m.ce_ring(r) + pos * chunk_bytes,
                                 out, count, scale if t == n - 2 else 1.0)
                kernels.flags(stream, arrived, [m.taken_flag(prev, pos, r)])
                gpu.record(ready[c], stream)
        for push in self.push[1:]:
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
        for event in (self.fork, self.pushed, *self.ready):
            gpu.destroy_event(event)
        self.ready = []
        for push in self.push:
            gpu.destroy_stream(push)
        self._made = False
