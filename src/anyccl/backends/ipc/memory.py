"""The memory the ipc kernels share: every rank's data buffer and signal area, mapped into every
other rank's process through CUDA IPC, and a few host-mapped status words per rank.

A data buffer holds two halves (alternate collectives use alternate halves) of 2 x nranks slots
each, then one ring of message slots per sending rank, then the copy-engine ring area, into
which the previous rank's copy engine pushes (`ce.py`). The signal area holds the flags the
kernels raise in each other's memory, then the copy-engine flags; it starts zeroed.
`kernels/primitives.cuh` describes the kernels' part of both layouts; the constants below
are the kernels' too: compiler.py defines them in the kernels' source (`KERNEL_DEFINES`).
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
from typing import Any

from ... import gpu, settings, tuning
from ...errors import RendezvousError, UnsupportedError
from ...store import Store

MAX_RANKS = 8            # ranks one set of kernels serves (the argument block's arrays)
THREADS = 512            # threads per block of every kernel
TILE_BYTES = 64 << 10    # the smallest tile: the signal area's flags are sized for it
SIG_FLAGS = 64           # u64 words of a signal area before its flag arrays
STATUS_WORDS = 8         # host-mapped status words per rank, of which:
STATUS_ABORT, STATUS_ERROR, STATUS_PEER, STATUS_EXPECTED, STATUS_GOT = 0, 1, 2, 3, 4
CE_POSITIONS = 64        # chunk positions in a copy-engine slot (flags are sized for this many)

# what the kernels' source is compiled with: the constants both sides must agree on
KERNEL_DEFINES = {"MAX_RANKS": MAX_RANKS, "THREADS": THREADS,
                  "MIN_TILE_BYTES": f"{TILE_BYTES}ULL", "SIG_FLAGS": SIG_FLAGS,
                  "STATUS_ABORT": STATUS_ABORT, "STATUS_ERROR": STATUS_ERROR,
                  "STATUS_PEER": STATUS_PEER, "STATUS_EXPECTED": STATUS_EXPECTED,
                  "STATUS_GOT": STATUS_GOT}


class Layout:
    """Sizes of one rank's buffers, the same on every rank (they come from the environment
    and the world size alone): halves for collectives, rings for messages."""

    def __init__(self, nranks: int) -> None:
        self.nranks = nranks
        # ANYCCL_IPC_HALF_MB: one half, split into 2 x nranks slots (a slot: what one rank can
        # push to another in one collective kernel); larger arrays take several kernels
        half = settings.IPC_HALF_MB.get()
        self.slot_bytes = max(TILE_BYTES, half // (2 * nranks) // TILE_BYTES * TILE_BYTES)
        self.half_bytes = self.slot_bytes * 2 * nranks
        self.max_tiles = self.slot_bytes // TILE_BYTES
        # the tuning table's ipc.tile: what a block of a collective moves between two flags
        tile = tuning.value("ipc.tile")
        self.tile_bytes = max(TILE_BYTES, min(self.slot_bytes, tile) // TILE_BYTES * TILE_BYTES)
        # ANYCCL_IPC_RING_MB: the message ring from each sender, in chunks of 1 MiB (a deep
        # ring keeps large messages streaming while the receiver drains it)
        self.chunk_bytes = 1 << 20
        self.slots = max(2, settings.IPC_RING_MB.get() // self.chunk_bytes)
        self.p2p_offset = 2 * self.half_bytes
        # ANYCCL_IPC_CE_MB: the copy-engine ring's area, into which the previous
        # rank pushes (0: no copy-engine path; none alone); an area under 128 KiB (two 64 KiB
        # chunks) is none
        ce = settings.IPC_CE_MB.get() if nranks > 1 else 0
        self.ce_ring_bytes = ce // TILE_BYTES * TILE_BYTES if ce >= 2 * TILE_BYTES else 0
        self.ce_offset = self.p2p_offset + nranks * self.slots * self.chunk_bytes
        self.data_bytes = self.ce_offset + self.ce_ring_bytes
        words = SIG_FLAGS + 2 * self.max_tiles * MAX_RANKS + 3 * MAX_RANKS * self.slots
        self.ce_sig_offset = 8 * words       # pushed [CE_POSITIONS][MAX_RANKS], then taken
        self.ce_flag_words = 2 * CE_POSITIONS * MAX_RANKS
        self.sig_bytes = 8 * (words + self.ce_flag_words)


def encode_peer(host: str, pid: int, data_handle: bytes, sig_handle: bytes) -> bytes:
    """What a rank publishes about its buffers: plain JSON (host, pid, two IPC handles in hex),
    so that reading a peer's entry can never run code."""
    return json.dumps({"host": host, "pid": pid, "data": data_handle.hex(),
                       "sig": sig_handle.hex()}).encode()


def decode_peer(payload: bytes, rank: int) -> tuple[str, int, bytes, bytes]:
    """(host, pid, data handle, signal handle) from rank `rank`'s published entry;
    RendezvousError for anything that is not exactly what `encode_peer` writes."""
    try:
        entry = json.loads(payload.decode())
        host, pid = entry["host"], entry["pid"]
        handles = bytes.fromhex(entry["data"]), bytes.fromhex(entry["sig"])
        if not isinstance(host, str) or isinstance(pid, bool) or not isinstance(pid, int) or \
                any(len(h) != gpu.IPC_HANDLE_BYTES for h in handles):
            raise ValueError("fields of the wrong type or size")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError) as exc:
        raise RendezvousError(f"the ipc backend's rendezvous: rank {rank}'s entry is not a "
                              f"peer-memory description ({exc}); is another program using "
                              f"this job's store?") from None
    return host, pid, *handles


class PeerAddresses:
    """Where things are in every rank's buffers, as this process maps them (`datas[q]`,
    `sigs[q]`: rank q's data and signal buffers), for rank `rank` of `size`."""

    def __init__(self, layout: Layout, rank: int, size: int, datas: list[int],
                 sigs: list[int]) -> None:
        self.layout, self.rank, self.size = layout, rank, size
        self.datas, self.sigs = datas, sigs

    # ---- the copy-engine area (ce.py) ---------------------------------------------------------
    def ce_ring(self, owner: int) -> int:
        """Rank `owner`'s ring area: where the previous rank's copy engine pushes."""
        return self.datas[owner] + self.layout.ce_offset

    def pushed_flag(self, owner: int, position: int, sender: int) -> int:
        """In `owner`'s signal area: `sender` pushed the chunk at `position` of owner's ring
        area (cleared by the owner when it takes it)."""
        return self.sigs[owner] + self.layout.ce_sig_offset + 8 * (position * MAX_RANKS + sender)

    def taken_flag(self, owner: int, position: int, taker: int) -> int:
        """In `owner`'s signal area: `taker` has taken the chunk `owner` pushed into
        `position` of taker's ring area, so owner may push there again (cleared by the owner
        when it does)."""
        return self.sigs[owner] + self.layout.ce_sig_offset + 8 * (
            (CE_POSITIONS + position) * MAX_RANKS + taker)


class PeerMemory(PeerAddresses):
    """This rank's buffers, exported; every peer's, opened. Collective over the ranks (through
    `store` under `key`); UnsupportedError if they are not all on this host."""

    def __init__(self, store: Store, key: str, rank: int, size: int, device: int,
                 timeout_s: float) -> None:
        if size > MAX_RANKS:
            raise UnsupportedError(f"the ipc backend serves up to {MAX_RANKS} GPUs of one node; "
                                   f"this communicator has {size} ranks")
        super().__init__(Layout(size), rank, size, [], [])
        self._opened: list[int] = []
        self.data = gpu.mem_alloc(self.layout.data_bytes)
        self.sig = gpu.mem_alloc(self.layout.sig_bytes)
        self.status_host, self.status_device = gpu.host_alloc_mapped(8 * STATUS_WORDS)
        ctypes.memset(self.status_host, 0, 8 * STATUS_WORDS)
        self.status = (ctypes.c_uint64 * STATUS_WORDS).from_address(self.status_host)
        self._release_stream = 0
        try:
            self._release_stream = gpu.new_stream(device)  # aborted() frees copy-engine waits
            gpu.memset(self.sig, 0, self.layout.sig_bytes)
            me = (socket.gethostname(), os.getpid(), gpu.ipc_handle(self.data),
                  gpu.ipc_handle(self.sig))
            store.set(f"{key}/{rank}", encode_peer(*me))
            everyone = [me if q == rank else decode_peer(store.get(f"{key}/{q}", timeout_s), q)
                        for q in range(size)]
            hosts = {q: host for q, (host, *_) in enumerate(everyone)}
            if len(set(hosts.values())) > 1:
                raise UnsupportedError(f"the ipc backend maps GPU memory between the processes "
                                       f"of one node, but the ranks run on several: {hosts}; "
                                       f"use backend='nccl'")
            for q, (_, _, data_handle, sig_handle) in enumerate(everyone):
                if q == rank:
                    self.datas.append(self.data)
                    self.sigs.append(self.sig)
                    continue
                for handle, into in ((data_handle, self.datas), (sig_handle, self.sigs)):
                    ptr = gpu.ipc_open(handle)
                    self._opened.append(ptr)
                    into.append(ptr)
        except BaseException:
            self.close()
            raise

    def aborted(self) -> None:
        """Tell every kernel of this rank to return (status[0], read while they spin), and
        release every stream waiting on a copy-engine flag (all raised, on a stream of its
        own: the waiting ones are stuck)."""
        self.status[STATUS_ABORT] = 1
        if self.sig and self.layout.ce_ring_bytes:
            gpu.memset32_async(self.sig + self.layout.ce_sig_offset, 1,
                               2 * self.layout.ce_flag_words, self._release_stream)

    def error(self) -> tuple[int, int, int, int]:
        """(error code, peer, expected, got) a kernel reported; code 0 when none."""
        s = self.status
        return s[STATUS_ERROR], s[STATUS_PEER], s[STATUS_EXPECTED], s[STATUS_GOT]

    def close(self) -> None:
        for ptr in self._opened:
            try:
                gpu.ipc_close(ptr)
            except gpu.CudaError:
                pass
        self._opened = []
        if self._release_stream:
            try:
                gpu.destroy_stream(self._release_stream)
            except gpu.CudaError:
                pass
            self._release_stream = 0
        for ptr, free in ((self.data, gpu.mem_free), (self.sig, gpu.mem_free),
                          (self.status_host, gpu.host_free)):
            if ptr:
                try:
                    free(ptr)
                except gpu.CudaError:
                    pass
        self.data = self.sig = self.status_host = 0


def describe_args(memory: PeerMemory) -> Any:
    """The kernels' argument block (kernels.cu: struct Args), filled with what never changes."""
    lay = memory.layout
    args = KernelArgs()
    for q in range(memory.size):
        args.data[q] = memory.datas[q]
        args.sig[q] = memory.sigs[q]
    args.half_bytes, args.slot_bytes = lay.half_bytes, lay.slot_bytes
    args.p2p_offset, args.chunk_bytes = lay.p2p_offset, lay.chunk_bytes
    args.tile_bytes = lay.tile_bytes
    args.status = memory.status_device
    args.scale = 1.0
    args.rank, args.nranks, args.root, args.peer = memory.rank, memory.size, 0, 0
    args.max_tiles, args.slots = lay.max_tiles, lay.slots
    return args


class KernelArgs(ctypes.Structure):
    """kernels.cu's struct Args, field for field (C layout rules on both sides)."""

    _fields_ = [
        ("data", ctypes.c_uint64 * MAX_RANKS),
        ("sig", ctypes.c_uint64 * MAX_RANKS),
        ("ins", ctypes.c_uint64 * MAX_RANKS),
        ("outs", ctypes.c_uint64 * MAX_RANKS),
        ("inp", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("count", ctypes.c_uint64),
        ("half_bytes", ctypes.c_uint64),
        ("slot_bytes", ctypes.c_uint64),
        ("p2p_offset", ctypes.c_uint64),
        ("chunk_bytes", ctypes.c_uint64),
        ("tile_bytes", ctypes.c_uint64),
        ("tag", ctypes.c_uint64),
        ("status", ctypes.c_uint64),
        ("scale", ctypes.c_float),
        ("rank", ctypes.c_int),
        ("nranks", ctypes.c_int),
        ("root", ctypes.c_int),
        ("peer", ctypes.c_int),
        ("max_tiles", ctypes.c_int),
        ("slots", ctypes.c_int),
        ("takers", ctypes.c_int),
    ]
