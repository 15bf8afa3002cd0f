"""all_reduce for large arrays by the copy engines: the GPUs' DMA engines move the data over
NVLink, a small kernel reduces what arrived in local memory, and stream memory operations
(write a flag in a peer's memory, wait for a flag in one's own) order the two across ranks.

Why: on 2 x H200 (NV18) the copy engines move 392-396 GB/s per direction where SM stores
reach 371, and a two-shot all_reduce driven by them reached 367 GB/s busbw at 256 MiB and 387 at
1 GiB against 334 for the SM kernels (`benchmarks/ce_allreduce.py`, `link_ceiling.py`).

The array is cut into `nranks` segments; rank q reduces segment q. Each segment is cut into
chunks; chunk k goes through position k % positions of the slots (memory.py: each rank's
copy-engine area has, for each peer, a slot for its contributions and one for its results).
Only pushes cross the link: an engine reading a peer's memory while the peer's engine writes the
other way was measured slower (ce_allreduce.py --back: 349 vs 372 GB/s at 256 MiB). For each
chunk, on four streams of this rank:

  push (P):    my part of each peer q's segment chunk -> q's contribution slot for me; raise
               pushed[position][me] at q
  reduce (S):  wait for pushed[position][q] of every peer and clear them; reduce my segment's
               chunk with the contributions into my array (the kernel `reduce_local`, local
               memory only); raise reduced[position][me] at every peer
  return (R):  after my reduction, and after each peer q raised reduced[position][q] (so q
               took my contribution at this position and copied out my previous result there),
               clear those flags; push my reduced chunk -> q's result slot for me; raise
               returned[position][me] at q
  local (L):   wait for returned[position][q] of every peer and clear them; copy q's result
               from my result slot for q into my array (a local copy)

S is the caller's stream; P, R and L fork from it and join it again at the end. A push into a
contribution position waits (an event) until R saw every peer take the chunk there; a reduction
into a position waits (an event) until L copied out the results at that position.

Flags are raised to 1 and cleared by the rank that waits on them, so every call queues the same
values (a CUDA graph can replay it). No flag is raised again before it was cleared, and no slot
written before it was read, by these chains: q pushes chunk k + positions (or the next call's
chunk) after its R saw this rank's reduced flag for chunk k, raised after this rank took (and
cleared) q's chunk k; q returns chunk k + positions after this rank's reduced flag for it, raised
after this rank's reduction k + positions, which waited for L to copy out (and clear) chunk k.
Each chunk's operations are queued in the order push, reduce, return, local: an order in which
the whole could also run on one queue, so streams that share a hardware queue cannot deadlock
(tests/test_ipc_copy_engines.py runs all of it in random orders, one queue or many).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ... import gpu
from .memory import CE_POSITIONS, TILE_BYTES, PeerMemory

MIN_CHUNK_BYTES = 4 << 20   # smaller chunks lose more to the per-chunk flags than they pipeline
CHUNKS = 4                  # chunks per segment where the slot allows (the experiment's best)


@dataclass(frozen=True)
class Plan:
    """How one all_reduce of `count` elements is cut: `seg` elements per rank's segment (a
    whole number of 16-byte packs), chunks of `chunk` elements, `chunks` of them per segment,
    through `positions` chunk positions of a slot."""

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


def plan(count: int, itemsize: int, nranks: int, slot_bytes: int, chunks: int = CHUNKS) -> Plan:
    """The cut for `count` elements of `itemsize` bytes over `nranks` ranks with slots of
    `slot_bytes` (a multiple of 64 KiB, at least two of them): chunks of 1/`chunks` of a
    segment, at least MIN_CHUNK_BYTES, at most half a slot (so at least two positions
    alternate), in 64 KiB steps."""
    pack = 16 // itemsize
    seg = -(-(-(-count // nranks)) // pack) * pack
    want = max(MIN_CHUNK_BYTES, -(-seg * itemsize // chunks))
    chunk_bytes = min(-(-want // TILE_BYTES) * TILE_BYTES,
                      slot_bytes // 2 // TILE_BYTES * TILE_BYTES)
    chunk = chunk_bytes // itemsize
    return Plan(count, seg, chunk, -(-seg // chunk),
                min(CE_POSITIONS, slot_bytes // chunk_bytes))


class CopyEngineAllReduce:
    """The streams and events of this rank's copy-engine all_reduces (made on first use)."""

    def __init__(self, memory: PeerMemory, device: int) -> None:
        self.memory = memory
        self.device = device
        self.slot_bytes = memory.layout.ce_slot_bytes
        self._made = False

    def _make(self) -> None:
        new_stream, new_event = gpu.new_stream, gpu.new_event
        self.push, self.back, self.local = (new_stream(self.device) for _ in range(3))
        self.fork, *self.joins = (new_event(self.device) for _ in range(4))
        self.reduced = [new_event(self.device) for _ in range(CE_POSITIONS)]
        self.taken = [new_event(self.device) for _ in range(CE_POSITIONS)]
        self.copied = [new_event(self.device) for _ in range(CE_POSITIONS)]
        self._made = True

    def enqueue(self, stream: int, ptr: int, p: Plan, itemsize: int,
                reduce: Callable[[int, list[int], int], None]) -> None:
        """Queue the all_reduce of the `p.count` elements at `ptr` on `stream`.
        `reduce(stream, [my chunk, then each peer's contribution], count)` queues the local
        reduction of `count` elements into my chunk."""
        if not self._made:
            self._make()
        m, r, n = self.memory, self.memory.rank, self.memory.size
        peers = [(r + i) % n for i in range(1, n)]
        chunk_bytes = p.chunk * itemsize
        sides = (self.push, self.back, self.local)
        gpu.record(self.fork, stream)
        for side in sides:
            gpu.stream_wait(side, self.fork)
        for k in range(p.chunks):
            pos = k % p.positions
            offset = pos * chunk_bytes
            reused = k >= p.positions
            if reused:                        # every peer took my chunk k - positions here
                gpu.stream_wait(self.push, self.taken[pos])
            for q in peers:                   # push: my part of q's segment, to q
                start, count = p.extent(q, k)
                if count:
                    gpu.copy_async(m.ce_slot(q, r) + offset, ptr + start * itemsize,
                                   count * itemsize, self.push)
                gpu.write_value(self.push, m.pushed_flag(q, pos, r), 1)
            for q in peers:                   # reduce my segment's chunk
                flag = m.pushed_flag(r, pos, q)
                gpu.wait_value(stream, flag, 1)
                gpu.write_value(stream, flag, 0)
            if reused:                        # results of chunk k - positions copied out
                gpu.stream_wait(stream, self.copied[pos])
            mine, count = p.extent(r, k)
            if count:
                reduce(stream, [ptr + mine * itemsize] + [m.ce_slot(r, q) + offset
                                                          for q in peers], count)
            for q in peers:
                gpu.write_value(stream, m.reduced_flag(q, pos, r), 1)
            gpu.record(self.reduced[pos], stream)
            gpu.stream_wait(self.back, self.reduced[pos])
            for q in peers:                   # return: my result, to every peer
                flag = m.reduced_flag(r, pos, q)
                gpu.wait_value(self.back, flag, 1)
                gpu.write_value(self.back, flag, 0)
            gpu.record(self.taken[pos], self.back)
            for q in peers:
                if count:
                    gpu.copy_async(m.ce_slot(q, r, returned=True) + offset,
                                   ptr + mine * itemsize, count * itemsize, self.back)
                gpu.write_value(self.back, m.returned_flag(q, pos, r), 1)
            for q in peers:                   # local: every peer's result, into my array
                flag = m.returned_flag(r, pos, q)
                gpu.wait_value(self.local, flag, 1)
                gpu.write_value(self.local, flag, 0)
                start, theirs = p.extent(q, k)
                if theirs:
                    gpu.copy_async(ptr + start * itemsize, m.ce_slot(r, q, returned=True)
                                   + offset, theirs * itemsize, self.local)
            gpu.record(self.copied[pos], self.local)
        for side, joined in zip(sides, self.joins):
            gpu.record(joined, side)
            gpu.stream_wait(stream, joined)

    def close(self) -> None:
        if not self._made:
            return
        for event in (self.fork, *self.joins, *self.reduced, *self.taken, *self.copied):
            gpu.destroy_event(event)
        for side in (self.push, self.back, self.local):
            gpu.destroy_stream(side)
        self._made = False
