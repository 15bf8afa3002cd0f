"""all_reduce for large arrays by the copy engines: the GPUs' DMA engines move the data over
NVLink, a small kernel reduces what arrived in local memory, and flags in the ranks' signal
areas (raised by one-thread kernels) order the two across ranks.

Why: the copy engines move more per direction over NVLink than SM stores do, and for the
largest arrays this path beats the two-shot kernels; below the tuning table's ipc.ce_min it
does not (the per-chunk flags cost more than the engines gain). The figures are in
benchmarks/results/ (the copy-engine all_reduce runs) and benchmarks/lab/ (the experiments
behind this design).

The array is cut into `nranks` segments; rank q reduces segment q. Each segment is cut into
chunks; chunk k goes through position k % positions of the slots (memory.py: one slot per
peer in each rank's copy-engine area). For each chunk, on three streams of this rank:

  push (P):   my part of each peer q's segment chunk -> q's slot for me; then raise
              pushed[position][me] in q's signal area
  reduce (S): wait for pushed[position][q] of every peer; reduce my segment's chunk with the
              slots into the output and into every slot (the kernel `reduce_local`, local
              memory only); clear those flags and raise reduced[position][me] at every peer
  pull (B):   wait for reduced[position][q] of every peer; copy each peer's reduced chunk from
              its slot for me into the output; clear those flags

Flags are written by a one-thread kernel (`ce_flags`) and waited for by another (`ce_wait`),
or by cuStreamWaitValue32 (the backend's `ce_memop_wait`, set only by lab/ce_modes.py). Not
written by cuStreamWriteValue32:
CUDA precedes it with a system-wide memory fence, which slows the copies in flight.

S is the caller's stream; P and B fork from it and join it again at the end. A push into a
position waits until this rank's pull from that position (chunk k - positions) finished.

Flags are raised to 1 and cleared by the rank that waits on them, so every call queues the same
values (a CUDA graph can replay it). No flag is raised again before it was cleared, and no slot
written before it was read: a rank pushes chunk k + positions (or the next call's chunk) only
after pulling chunk k (and clearing its reduced flags), whose reduced flag the peer raised only
after reading the slot and clearing its pushed flag (one kernel: clear, fence, raise); a rank
reduces only after every peer pushed the chunk, which each did only after pulling what this
rank left in that position before. Each chunk's operations are queued in the order push,
reduce, pull, an order in which the whole could also run on one queue, so streams that share a
hardware queue cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ... import gpu, tuning
from .memory import CE_POSITIONS, TILE_BYTES, PeerMemory

MIN_CHUNK_BYTES = 4 << 20   # smaller chunks lose more to the per-chunk flags than they pipeline
CHUNKS = tuning.TABLE["ipc.ce_chunks"].default  # chunks per segment where the slot allows


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
    per_rank = -(-count // nranks)  # ceiling divisions
    seg = -(-per_rank // pack) * pack
    want = max(MIN_CHUNK_BYTES, -(-seg * itemsize // chunks))
    chunk_bytes = min(-(-want // TILE_BYTES) * TILE_BYTES,
                      slot_bytes // 2 // TILE_BYTES * TILE_BYTES)
    chunk = chunk_bytes // itemsize
    return Plan(count, seg, chunk, -(-seg // chunk),
                min(CE_POSITIONS, slot_bytes // chunk_bytes))


class Kernels(Protocol):
    """What `CopyEngineAllReduce.enqueue` queues besides copies (the backend's kernels)."""

    def reduce(self, stream: int, arrays: list[int], count: int) -> None:
        """Queue the reduction of `count` elements of every array (this rank's first) into
        every one of them."""

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

    def _make(self) -> None:
        self.push, self.pull = gpu.new_stream(self.device), gpu.new_stream(self.device)
        self.fork, self.pushed, self.pulled_all = (gpu.new_event(self.device) for _ in range(3))
        self.pulled = [gpu.new_event(self.device) for _ in range(CE_POSITIONS)]
        self._made = True

    def enqueue(self, stream: int, ptr: int, p: Plan, itemsize: int, kernels: Kernels) -> None:
        """Queue the all_reduce of the `p.count` elements at `ptr` on `stream`."""
        if not self._made:
            self._make()
        m, r, n = self.memory, self.memory.rank, self.memory.size
        peers = [(r + i) % n for i in range(1, n)]
        chunk_bytes = p.chunk * itemsize
        gpu.record(self.fork, stream)
        gpu.stream_wait(self.push, self.fork)
        gpu.stream_wait(self.pull, self.fork)
        for k in range(p.chunks):
            pos = k % p.positions
            offset = pos * chunk_bytes
            if k >= p.positions:              # this position's last pull finished
                gpu.stream_wait(self.push, self.pulled[pos])
            for q in peers:                   # push: my part of q's segment, to q
                start, count = p.extent(q, k)
                if count:
                    gpu.copy_async(m.ce_slot(q, r) + offset, ptr + start * itemsize,
                                   count * itemsize, self.push)
            kernels.flags(self.push, [], [m.pushed_flag(q, pos, r) for q in peers])
            taken = [m.pushed_flag(r, pos, q) for q in peers]
            kernels.wait(stream, taken)       # reduce my segment's chunk
            start, count = p.extent(r, k)
            if count:
                kernels.reduce(stream, [ptr + start * itemsize] + [m.ce_slot(r, q) + offset
                                                                   for q in peers], count)
            kernels.flags(stream, taken, [m.reduced_flag(q, pos, r) for q in peers])
            results = [m.reduced_flag(r, pos, q) for q in peers]
            kernels.wait(self.pull, results)  # pull: each peer's reduced chunk
            for q in peers:
                start, count = p.extent(q, k)
                if count:
                    gpu.copy_async(ptr + start * itemsize, m.ce_slot(q, r) + offset,
                                   count * itemsize, self.pull)
            kernels.flags(self.pull, results, [])
            gpu.record(self.pulled[pos], self.pull)
        gpu.record(self.pushed, self.push)
        gpu.record(self.pulled_all, self.pull)
        gpu.stream_wait(stream, self.pushed)
        gpu.stream_wait(stream, self.pulled_all)

    def close(self) -> None:
        if not self._made:
            return
        for event in (self.fork, self.pushed, self.pulled_all, *self.pulled):
            gpu.destroy_event(event)
        gpu.destroy_stream(self.push)
        gpu.destroy_stream(self.pull)
        self._made = False
