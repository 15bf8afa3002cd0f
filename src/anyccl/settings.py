"""Every `ANYCCL_*` environment variable, declared once: its type, unit, default and what it does.

Code reads a setting through its declaration (`settings.TIMEOUT.get()`), never `os.environ`
directly, so every variable is parsed the same way and a bad value is an `InvalidArgumentError`
that names the variable and says what was expected. Sizes accept what people type ("64K", "1M",
"2G"); a bare number is read in the unit the variable's name carries (`ANYCCL_IPC_CE_MB=512` is
512 MiB, `ANYCCL_SHM_STAGING_BYTES=4096` is 4096 bytes). Size thresholds that choose an
algorithm live in the tuning table instead (tuning.py), overridden by `ANYCCL_TUNING`. The
docs' settings table is generated from `SETTINGS`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ._units import size_of
from .errors import InvalidArgumentError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20}


@dataclass(frozen=True)
class Setting:
    """One environment variable. kind: "size" (bytes; `unit` is what a bare number means),
    "int", "float", "seconds", "bool", "text" or "path"."""

    name: str
    kind: str
    default: Any
    doc: str
    unit: str = ""
    minimum: float | None = None
    set_by_launcher: bool = False

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())

    def get(self) -> Any:
        """The variable's value, parsed; the default when it is unset or empty."""
        text = os.environ.get(self.name, "").strip()
        if not text:
            return self.default
        return self.parse(text)

    def parse(self, text: str) -> Any:
        """`text` as this setting's type; InvalidArgumentError naming the variable if not."""
        value: Any
        if self.kind == "size":
            value = size_of(text, _UNITS[self.unit])
            if value is None:
                self._refuse(text, f"a size, e.g. 64K, 16M, 1G, or a number of {self.unit}")
        elif self.kind == "int":
            try:
                value = int(text)
            except ValueError:
                self._refuse(text, "an integer")
        elif self.kind in ("float", "seconds"):
            try:
                value = float(text)
            except ValueError:
                self._refuse(text, "a number" + (" of seconds" if self.kind == "seconds" else ""))
            if value != value or value in (float("inf"), float("-inf")):
                self._refuse(text, "a finite number")
        elif self.kind == "bool":
            lowered = text.lower()
            if lowered not in _TRUE + _FALSE:
                self._refuse(text, "1 or 0 (true/false, yes/no, on/off)")
            value = lowered in _TRUE
        else:
            value = text
        if self.minimum is not None and value < self.minimum:
            least = (f"{_format_size(int(self.minimum))} bytes" if self.kind == "size" else
                     f"{self.minimum:g}" + (f" {self.unit}" if self.unit else ""))
            self._refuse(text, f"at least {least}")
        return value

    def _refuse(self, text: str, expected: str) -> None:
        raise InvalidArgumentError(f"environment variable {self.name}={text!r} is not valid; "
                                   f"expected {expected}")

    def default_text(self) -> str:
        """The default as the docs show it."""
        if self.default is None:
            return "-"
        if self.kind == "size":
            return _format_size(self.default)
        if self.kind == "bool":
            return "1" if self.default else "0"
        return str(self.default)


def _format_size(n: int) -> str:
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


SETTINGS: dict[str, Setting] = {}


def _declare(name: str, kind: str, default: Any, doc: str, **more: Any) -> Setting:
    setting = Setting(f"ANYCCL_{name}", kind, default, doc, **more)
    SETTINGS[setting.name] = setting
    return setting


# ---- every rank, every backend ---------------------------------------------------------------
BACKEND = _declare("BACKEND", "text", None,
                   "The backend when init() names none: shm, mpi, nccl, ipc, auto, or a device "
                   "map such as cpu:shm,cuda:nccl. Default: shm on one host (also under "
                   "mpiexec); across hosts shm+mpi under mpiexec (with mpi4py), else "
                   "shm+gloo.")
TIMEOUT = _declare("TIMEOUT", "seconds", 600.0,
                   "How long any one operation may wait before it fails with anyccl.TimeoutError "
                   "(init(timeout=...) wins).", unit="s", minimum=1e-3)
DEBUG = _declare("DEBUG", "bool", False,
                 "Check before every collective (GPU ones too) that all ranks called the same "
                 "one, at the same sequence number, with agreeing arguments "
                 "(CollectiveMismatchError otherwise). Host collectives check op, dtype, count, "
                 "root and reduce op without it.")
FULL_TRACEBACK = _declare("FULL_TRACEBACK", "bool", False,
                          "Under anyccl run, show anyccl's own frames in the traceback of an "
                          "error a rank did not catch. Off: of each run of anyccl's frames only "
                          "the call your code made is shown, and a line says how many were left "
                          "out.")
FLIGHT_DIR = _declare("FLIGHT_DIR", "path", None,
                      "Where flight records are written on a timeout or a lost peer (in a "
                      "private anyccl-<job> directory below it). Default: this user's private "
                      "directory, $XDG_RUNTIME_DIR/anyccl or <tmp>/anyccl-<uid>.")
JOB_KEY = _declare("JOB_KEY", "text", None,
                   "The job's secret (hexadecimal): every connection to the rendezvous store "
                   "must prove it knows it. anyccl run sets a fresh one.", set_by_launcher=True)
ALLOW_UNAUTHENTICATED_STORE = _declare(
    "ALLOW_UNAUTHENTICATED_STORE", "bool", False,
    "Let a tcp:// or MASTER_ADDR rendezvous on a non-loopback address run without "
    "ANYCCL_JOB_KEY (anyone who reaches the port could then join the job). Off: refused.")
STORE = _declare("STORE", "text", None,
                 "host:port of the rendezvous store anyccl run serves for its ranks.",
                 set_by_launcher=True)
JOB_ID = _declare("JOB_ID", "text", None,
                  "A short name for the job, used in shared-memory and flight-record names.",
                  set_by_launcher=True)
JOB_PREFIX = _declare("JOB_PREFIX", "text", None,
                      "Letters and digits put in front of the id of every job started under it "
                      "(anyccl run, init() without a launcher's ANYCCL_JOB_ID), so that its "
                      "shared-memory segments (/dev/shm/anyccl-<prefix>...) and flight records "
                      "can be told apart from other jobs' on the same machine.")


SOCKET_IFNAME = _declare("SOCKET_IFNAME", "text", None,
                         "The network interface (e.g. eth0) whose address other hosts reach this "
                         "one at: for the rendezvous store and the engine between hosts. "
                         "Default: GLOO_SOCKET_IFNAME if set, else the address the hostname "
                         "resolves to, else the first interface that is not loopback.")
PEER_SILENCE = _declare("PEER_SILENCE", "seconds", 10.0,
                        "Across hosts: a rank waiting on a peer that gave no sign of life (its "
                        "heartbeat in the job's store) for this long raises PeerLostError "
                        "naming it and its host, before the operation's deadline.", unit="s",
                        minimum=0.5)
KEEP_GOING = _declare("KEEP_GOING", "bool", False,
                      "The job goes on when a rank dies (its survivors call comm.shrink()): "
                      "where rank 0 would serve the rendezvous store (mpiexec, SLURM, tcp://), "
                      "it starts it as a process of its own that outlives every rank. Set by "
                      "`anyccl run --keep-going` (whose launcher serves the store anyway); "
                      "under mpiexec, also keep the others running (MPICH: mpiexec "
                      "-disable-auto-cleanup).")
NEWCOMER = _declare("NEWCOMER", "bool", False,
                    "This process replaces a lost rank (or adds one) in a running job: "
                    "anyccl.init() joins it as anyccl.join() does, returning the communicator "
                    "its ranks grow next (comm.grow()). Set by `anyccl run --replace` on the "
                    "processes it starts in place of dead ranks.")
LAUNCHER_PID = _declare("LAUNCHER_PID", "int", None,
                        "The pid of anyccl run: ranks exit when it dies.", set_by_launcher=True)

TUNING = _declare("TUNING", "text", None,
                  "Thresholds of the tuning table to override, as key=value pairs separated by "
                  "commas (\"shm.one_shot_max=64K,ipc.ce_min=256M\"); the same on every rank. "
                  "`anyccl info` lists the keys, their values and what each decides.")

# ---- shm -------------------------------------------------------------------------------------
SHM_STAGING_BYTES = _declare("SHM_STAGING_BYTES", "size", 1 << 20,
                             "Each of the two staging halves of a rank's segment (collectives "
                             "stream through them).", unit="bytes", minimum=4096)
SHM_CHANNEL_BYTES = _declare("SHM_CHANNEL_BYTES", "size", None,
                             "The message ring from each rank to each other rank. Default: "
                             "4 MiB and a 32-byte header on 2 ranks (a message that fits "
                             "whole goes in one call each way: sendrecv of 1-2 MiB at "
                             "1.38-1.76x MPICH's busbw, 0.82-0.98x through a 1 MiB ring in "
                             "pieces), 1 MiB on more.",
                             unit="bytes", minimum=64)
SHM_CMA = _declare("SHM_CMA", "bool", True,
                   "Move large messages once, reading the peer's memory directly "
                   "(process_vm_readv), where the kernel allows it.")
SPIN_US = _declare("SPIN_US", "float", None,
                   "How long a waiting rank spins before it sleeps. Default: 200 on shm and "
                   "20000 on mpi; where a host's ranks outnumber the cores they may use (their "
                   "affinity mask), shm spins 100 and every turn of a spin yields the core.",
                   unit="us", minimum=0)

# ---- mpi -------------------------------------------------------------------------------------
MPI_AGREE = _declare("MPI_AGREE", "bool", True,
                     "Compare every host collective's op, dtype, count, root and reduce op across "
                     "ranks before it runs (one all-reduce of a 96-byte envelope each; an "
                     "all_reduce of up to 64 bytes rides inside it, one MPI call for both). "
                     "Off: mismatches MPI does not catch itself give wrong numbers.")
MPI_STAGING_CHUNK = _declare("MPI_STAGING_CHUNK", "size", 4 << 20,
                             "GPU arrays on mpi: the chunk that all_reduce and broadcast stream "
                             "through pinned host memory.", unit="bytes", minimum=1)

# ---- GPUs ------------------------------------------------------------------------------------
CACHE_DIR = _declare("CACHE_DIR", "path", None,
                     "Where compiled parts are kept: the ipc kernels (NVRTC) and the torch "
                     "process group's part (torch_core.py). Default: ~/.cache/anyccl.")
ROUTES_FILE = _declare("ROUTES_FILE", "path", None,
                       "Where `anyccl tune` writes the measured routes of the ipc `auto` policy "
                       "and where `auto` looks for them first. Default: "
                       "~/.cache/anyccl/routes.json.")
TORCH_CORE = _declare("TORCH_CORE", "bool", True,
                      "The torch process group's compiled part (streams, Work and future of each "
                      "operation, and its all_reduce as a C++ backend of torch's), built against "
                      "the installed torch on first use and kept in the cache directory; off: "
                      "the group's Python code alone.")
IPC_BLOCKS = _declare("IPC_BLOCKS", "int", 128, "Thread blocks per ipc kernel, at most.",
                      minimum=1)
IPC_HALF_MB = _declare("IPC_HALF_MB", "size", 256 << 20,
                       "Each of the two halves of a rank's ipc buffer that collectives use.",
                       unit="MiB", minimum=1 << 20)
IPC_RING_MB = _declare("IPC_RING_MB", "size", 128 << 20,
                       "The ipc message ring from each sender.", unit="MiB", minimum=2 << 20)
IPC_CE_MB = _declare("IPC_CE_MB", "size", 512 << 20,
                     "The copy-engine ring's area on each GPU (all_reduce, reduce_scatter and "
                     "all_gather of large arrays), into which the "
                     "previous rank pushes; 0 turns the copy engines off and saves that memory.",
                     unit="MiB",
                     minimum=0)


def table() -> str:
    """Every setting as a Markdown table (the docs' settings page)."""
    rows = ["| variable | type | default | what it does |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        kind = s.kind + (f" ({s.unit})" if s.unit else "")
        doc = s.doc + (" Set by `anyccl run`." if s.set_by_launcher else "")
        rows.append(f"| `{s.name}` | {kind} | `{s.default_text()}` | {doc} |")
    return "\n".join(rows)
