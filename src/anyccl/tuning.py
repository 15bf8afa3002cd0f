"""The tuning table: every size threshold and algorithm choice of every backend, in one place.

Each threshold names the backend that reads it (`shm.one_shot_max`), what it decides and its
default; the defaults come from measured runs (docs/benchmarks.md says which). One setting,
`ANYCCL_TUNING`, overrides any of them: ``ANYCCL_TUNING="shm.one_shot_max=64K,ipc.ce_min=256M"``.
It must be the same on every rank of a job, since ranks pick the same schedule only when they
read the same table. `anyccl info` prints the table in force. The ipc backend's `auto` policy
(which sizes run on its kernels, which on NCCL) is a measured table of its own, `routes.json`
beside the backend, kept as data and printed beside this one.

Backends read their thresholds when they are created (`value`), never per call.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import settings
from ._units import size_of, size_text
from .errors import InvalidArgumentError


@dataclass(frozen=True)
class Threshold:
    """One entry: `kind` "size" (bytes; "64K", "1M" accepted) or "count" (at least `least`)."""

    key: str
    kind: str
    default: int
    what: str
    least: int = 1


_K, _M, _G = 1 << 10, 1 << 20, 1 << 30

TABLE: dict[str, Threshold] = {t.key: t for t in (
    # every host backend (engine.py)
    Threshold("engine.held_recv_max", "size", 4 * _K,
              "an irecv up to this size, issued with nothing else outstanding, is held "
              "instead of posted until its Work is waited on or polled, or the next call "
              "(its sender's transport writes so small a message whole without it); larger "
              "ones are posted at once"),
    # shm: algorithms/symmetric.py and algorithms/direct.py over shared memory
    Threshold("shm.one_shot_max", "size", 128 * _K,
              "all_reduce and reduce up to this size: one shot (every rank reduces every "
              "rank's data; one barrier); above: two shots (each rank reduces a slice, then "
              "all copy it)"),
    Threshold("shm.direct_min.all_reduce", "size", 2 * _M,
              "all_reduce from this size: ranks read each other's arrays directly "
              "(process_vm_readv) instead of staging through shared memory"),
    Threshold("shm.direct_min.broadcast", "size", 1 * _M,
              "broadcast from this size: read directly from the root's array (staged below: "
              "faster while the staging stays in cache, and 3x slower when the machine's cache "
              "is contended)"),
    Threshold("shm.direct_min.broadcast.crowded", "size", 4 * _M,
              "the same where a host's ranks outnumber the cores of some rank's affinity mask: "
              "staged reads leave the cores to the ranks that copy"),
    Threshold("shm.direct_min.all_gather", "size", 256 * _K,
              "all_gather from this size: read directly from the peers' arrays"),
    Threshold("shm.direct_min.gather", "size", 256 * _K,
              "gather from this size: the root reads directly from the peers' arrays"),
    Threshold("shm.direct_min.scatter", "size", 256 * _K,
              "scatter from this size: read directly from the root's pieces"),
    Threshold("shm.direct_min.message", "size", 8 * _M,
              "a message from this size, where it is also larger than its channel: the "
              "receiver reads it directly out of the sender's memory (one copy) instead of "
              "taking it through the channel in pieces (with more ranks than cores: every "
              "message larger than its channel)"),
    Threshold("shm.direct_chunk", "size", 8 * _M,
              "direct all_reduce: the chunk each rank takes a slice of, so that every rank "
              "works at once"),
    Threshold("shm.direct_block", "size", 512 * _K,
              "direct all_reduce: peers' data is read and reduced in blocks of this size "
              "(kept in L2)"),
    # shm inside each host, an engine between hosts (backends/hierarchical.py)
    Threshold("hierarchical.slice_min", "size", 64 * _K,
              "all_reduce below this: reduced inside the host, then on every column at once; "
              "from it: reduce-scatter inside, all_reduce of each slice between hosts, "
              "all-gather inside"),
    Threshold("hierarchical.chunk", "size", 2 * _M,
              "all_reduce across hosts is pipelined in chunks of this size, so that one chunk "
              "crosses the network while the next is reduced inside the host (one gloo "
              "operation costs 1-2 ms on a 2-core machine: smaller chunks lose)"),
    Threshold("hierarchical.max_chunks", "count", 16,
              "at most this many chunks per all_reduce across hosts"),
    # mpi (backends/mpi.py)
    Threshold("mpi.split_all_reduce_min", "size", 256 * _K,
              "the all_reduce between hosts (one rank per host, under the hierarchical "
              "engine) from this size, and the reduce_scatter on 3 ranks or more: a ring over "
              "point-to-point messages on a thread of its own (2(n-1)/n of the array per rank; "
              "MPICH's own all_reduce of 3 ranks reached under half a shaped link)"),
    Threshold("mpi.pair_ring_min", "size", _M,
              "on 2 ranks, the all_reduce between hosts runs on the ring thread from this "
              "size; below it, MPI's own all_reduce (with one chunk there is nothing to overlap; "
              "2 hosts x 2 ranks at 1 MiB, 16 cores, 2 Gbit/s: 1.00x MPICH's busbw on MPI's "
              "call at f308d8a, 0.91x on the thread at 2bf90f4; with this threshold at 2a60aa8: "
              "0.99x at 1 MiB, 1.00x at 2 MiB, 1.10x at 4 MiB)"),
    Threshold("mpi.chain_broadcast_min", "size", _M,
              "a broadcast between hosts (one rank per host, under the hierarchical engine) "
              "on 3 ranks or more from this size: a chain in segments, each link carrying the "
              "array once (MPICH's broadcast of 3-4 ranks sends it twice from the root)"),
    Threshold("mpi.chain_segment", "size", 512 * _K,
              "the broadcast chain's segment: each rank forwards one while the next arrives"),
    Threshold("mpi.hot_max", "size", _G,
              "a blocking all_reduce, broadcast or all_gather of NumPy arrays up to this size "
              "(x's bytes; at most 2 GiB - 1, MPI's int counts) runs whole in compiled code: "
              "the agreement's envelope, then the MPI call in place, without the Python path "
              "between them; above, the Python path (2 ranks on 2 cores, medians of three "
              "jobs: broadcast 0.92-1.02x mpi4py's busbw at 64 KiB - 64 MiB, 0.66-0.97x on "
              "the Python path)"),
    Threshold("mpi.exchange_max", "size", 64 * _K,
              "a blocking sendrecv of NumPy arrays whose messages are at most this size posts "
              "both from compiled code (MPI_Isend from a copy the communicator keeps, "
              "MPI_Irecv); larger ones take the Python path"),
    # ipc: CUDA peer memory (backends/ipc/)
    Threshold("ipc.tile", "size", 256 * _K,
              "what one block of an ipc collective moves between two flags"),
    Threshold("ipc.tile_min", "size", 4 * _K,
              "the smallest tile: an array is cut into tiles no smaller than this, one "
              "block's share each, so that a small array is pushed by more blocks (each tile "
              "carries its own flag)", least=1 * _K),
    Threshold("ipc.takers", "count", 0,
              "blocks of an ipc collective that copy out or reduce what arrived while the "
              "others push (0: every block does both, the next tile's pushes before the last "
              "one's takes)", least=0),
    Threshold("ipc.ll_max", "size", 1 * _M,
              "all_reduce up to this size: lines of data and flags, every rank's to every "
              "rank (one shot); on n >= 3 ranks up to this / (n - 1), the same bytes pushed "
              "per rank (4 H100s: the two shots of lines faster from 512 KiB)"),
    Threshold("ipc.ll_two_shot_max", "size", 2 * _M,
              "all_reduce above ipc.ll_max up to this size, on 3 ranks or more: lines of data "
              "and flags in two shots (reduce-scatter, then all-gather; 4 H100s: 1.0-1.1x the "
              "tiles' one and two shots at 1-2 MiB, 0.8x the two shots at 4 MiB)", least=0),
    Threshold("ipc.one_shot_max", "size", 2 * _M,
              "all_reduce up to this size: one shot (every rank pushes everything); two shots "
              "above"),
    Threshold("ipc.ce_min", "size", 256 * _M,
              "all_reduce from this size (reduce_scatter and all_gather from a whole of it): "
              "the copy engines move the data, in a ring"),
    Threshold("ipc.ce_chunks", "count", 4,
              "chunks per segment of the copy-engine ring, at most (a chunk stays at "
              "32 MiB or more)"),
)}

_parsed: tuple[str, dict[str, int]] | None = None


def overrides() -> dict[str, int]:
    """What `ANYCCL_TUNING` sets, checked: an unknown key or a value that does not parse is an
    InvalidArgumentError naming it."""
    global _parsed
    text = settings.TUNING.get() or ""
    if _parsed is not None and _parsed[0] == text:
        return _parsed[1]
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = (s.strip() for s in item.partition("="))
        entry = TABLE.get(key)
        if entry is None or not sep:
            raise InvalidArgumentError(
                f"ANYCCL_TUNING: {item!r} is not key=value with a known key; the keys are: "
                f"{', '.join(TABLE)}")
        value = size_of(raw, 1) if entry.kind == "size" else \
            (int(raw) if raw.isdigit() else None)
        if value is None or (entry.kind == "count" and value < entry.least):
            expected = "a size, e.g. 64K, 16M, or a number of bytes" \
                if entry.kind == "size" else f"a whole number of at least {entry.least}"
            raise InvalidArgumentError(f"ANYCCL_TUNING: {key}={raw!r} is not valid; expected "
                                       f"{expected}")
        values[key] = value
    _parsed = (text, values)
    return values


def value(key: str) -> int:
    """The threshold `key` in force: ANYCCL_TUNING's value, else the default."""
    return overrides().get(key, TABLE[key].default)


def rows() -> list[tuple[str, int, bool, str]]:
    """The table in force: (key, value, overridden, what) for every threshold."""
    set_here = overrides()
    return [(t.key, set_here.get(t.key, t.default), t.key in set_here, t.what)
            for t in TABLE.values()]


def format_value(key: str, amount: int) -> str:
    """A threshold's value as people read it: 128 KiB, 2 MiB, 16."""
    return size_text(amount) if TABLE[key].kind == "size" else str(amount)


def markdown() -> str:
    """The table with its defaults, as Markdown (the docs' settings page)."""
    lines = ["| key | default | what it decides |", "|---|---|---|"]
    lines += [f"| `{t.key}` | {format_value(t.key, t.default)} | {t.what} |"
              for t in TABLE.values()]
    return "\n".join(lines)
