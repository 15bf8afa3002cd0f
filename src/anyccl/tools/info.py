"""`anyccl info`: what this machine offers anyccl: versions, backends, GPUs and their links.

Everything is probed, nothing assumed: a backend is listed as available only if its library
imports, GPUs only if the CUDA runtime sees them, links only if NVML reports them.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from typing import Any


def _try(fn: Any, default: Any = None) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - info reports what it can
        return default


def backends() -> list[tuple[str, str, str]]:
    """(name, devices it serves, status) for every registered backend."""
    from ..backends import registry

    rows = [(name, entry.serves, _try(entry.status, "not usable: its status check failed"))
            for name, entry in registry.host_backends().items()]
    rows += [(name, entry.serves, _try(entry.status, "not usable: its status check failed"))
             for name, entry in registry.gpu_backends().items()]
    return rows


def _nccl_version() -> str | None:
    from ..backends.nccl import version

    return version()


def gpus() -> list[dict[str, Any]]:
    from .. import gpu

    found = []
    for d in range(gpu.device_count()):
        props = _try(lambda d=d: gpu.device_properties(d))
        found.append({
            "index": d,
            "name": gpu.device_name(d),
            "memory_gib": round(props.totalGlobalMem / 2**30, 1) if props else None,
            "pci": gpu.pci_address(d, props) if props else "?",
            "capability": f"{props.major}.{props.minor}" if props else "?",
        })
    return found


def links(devices: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    """(i, j) -> "NV18" (NVLinks between the pair, from NVML), "P2P" (peer access without
    NVLink: PCIe) or "-" (no peer access)."""
    from .. import gpu

    nvlinks = _try(lambda: _nvlink_counts(devices), {}) or _try(_nvidia_smi_topology, {})
    table = {}
    for a in devices:
        for b in devices:
            i, j = a["index"], b["index"]
            if i == j:
                continue
            n = nvlinks.get((i, j), 0)
            peer = _try(lambda i=i, j=j: gpu.can_access_peer(i, j), False)
            table[(i, j)] = f"NV{n}" if n else ("P2P" if peer else "-")
    return table


def _nvlink_counts(devices: list[dict[str, Any]]) -> dict[tuple[int, int], int]:
    import pynvml

    pynvml.nvmlInit()
    try:
        by_bus = {}
        handles = {}
        for d in devices:
            h = pynvml.nvmlDeviceGetHandleByPciBusId(f"{d['pci']}.0")
            handles[d["index"]] = h
            by_bus[pci_key(pynvml.nvmlDeviceGetPciInfo(h).busId)] = d["index"]
        counts: dict[tuple[int, int], int] = {}
        for i, h in handles.items():
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                if _try(lambda h=h, link=link: pynvml.nvmlDeviceGetNvLinkState(h, link)) != 1:
                    continue
                remote = _try(lambda h=h, link=link:
                              pynvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(h, link).busId)
                j = by_bus.get(pci_key(remote)) if remote is not None else None
                if j is not None:
                    counts[(i, j)] = counts.get((i, j), 0) + 1
        return counts
    finally:
        pynvml.nvmlShutdown()


def _nvidia_smi_topology() -> dict[tuple[int, int], int]:
    """NVLink counts from `nvidia-smi topo -m` ("NV18" cells), where NVML gave none."""
    import re
    import subprocess

    text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                          timeout=20).stdout
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    counts = {}
    for line in text.splitlines():
        row = re.match(r"GPU(\d+)\s+(.*)", line)
        if not row:
            continue
        for j, cell in enumerate(row.group(2).split()):
            link = re.fullmatch(r"NV(\d+)", cell)
            if link:
                counts[(int(row.group(1)), j)] = int(link.group(1))
    return counts


def _nvidia_smi_pci_topology() -> dict[tuple[str, str], int]:
    """NVLink counts between GPUs named by PCI address ("0000:18:00"), from nvidia-smi: its
    topology matrix, with its own GPU order mapped to PCI addresses (nvidia-smi sees every GPU,
    whatever CUDA_VISIBLE_DEVICES says)."""
    import subprocess

    listed = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id",
                             "--format=csv,noheader"], capture_output=True, text=True,
                            timeout=20).stdout
    pci = {}
    for line in listed.splitlines():
        index, _, bus = (part.strip() for part in line.partition(","))
        if index.isdigit():
            pci[int(index)] = pci_key(bus)
    return {(pci[i], pci[j]): k for (i, j), k in _nvidia_smi_topology().items()
            if i in pci and j in pci}


def pci_key(address: Any) -> str:
    """A PCI address (text, or NVML's bytes) as bus:device, whatever its domain's width and
    function ("00000000:18:00.0" and "0000:18:00" are both "18:00")."""
    text = (address.decode() if isinstance(address, bytes) else str(address)).strip().lower()
    if text.count(":") == 2:
        text = text.split(":", 1)[1]
    return text.split(".", 1)[0]


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    import anyccl

    print(f"anyccl {anyccl.__version__} on Python {platform.python_version()} "
          f"({sys.executable}), NumPy {np.__version__}, {platform.system()} "
          f"{platform.machine()}, {os.cpu_count()} CPUs")
    print("\nbackends:")
    for name, serves, status in backends():
        print(f"  {name:<10} {serves:<26} {status}")
    devices = _try(gpus, [])
    from .. import gpu

    print(f"\nGPUs: {len(devices)} visible (CUDA_VISIBLE_DEVICES={gpu.visible_devices()})")
    for d in devices:
        print(f"  GPU {d['index']}: {d['name']}, {d['memory_gib']} GiB, compute capability "
              f"{d['capability']}, PCI {d['pci']}")
    print(f"  CUDA calls: {_try(_cuda_calls, 'unknown')}")
    if len(devices) > 1:
        table = links(devices)
        print("\nlinks (NVn: n NVLinks; P2P: peer access over PCIe; -: none):")
        print("        " + "".join(f"GPU{j:<5}" for j in range(len(devices))))
        for i in range(len(devices)):
            cells = "".join(f"{'X' if i == j else table[(i, j)]:<8}"
                            for j in range(len(devices)))
            print(f"  GPU{i:<3} {cells}")
    print("\nrouting: host arrays (NumPy, torch CPU) -> shm (under mpiexec too; mpi when "
          "named); GPU arrays (torch, CuPy, JAX, DLPack) -> "
          + ("nccl" if _try(_nccl_version) else "nccl once installed"))
    print("  ranks on several hosts: host arrays -> shm+mpi under mpiexec, else shm+gloo (shm "
          "inside each host, MPI or torch's gloo between); GPU arrays -> nccl")
    print(f"  address other hosts reach this one at: {_try(_address, 'none found')}")
    print(f"operation records: {records()}")
    print(f"\ntorch.distributed backend: {torch_backend()}")
    if importlib.util.find_spec("torch") is not None:
        from .. import torch_core

        print(f"  its operations' streams, Work and future, and its all_reduce as a torch "
              f"C++ backend: {torch_core.status()}")
    print("\n" + tuning_table())
    return 0


def records() -> str:
    """Which OpRecord every operation makes: the compiled one, or trace.py's own class."""
    from .. import trace

    if trace.OpRecord is trace._OpRecord:
        return "trace.py's class (the compiled one, _recordcore, was not built)"
    return "compiled (_recordcore)"


def tuning_table() -> str:
    """The tuning table in force (tuning.py), and the ipc auto policy's measured routes."""
    from .. import tuning
    from ..errors import InvalidArgumentError

    lines = ["tuning (override any with ANYCCL_TUNING=key=value,...; the same on every rank):"]
    try:
        rows = tuning.rows()
    except InvalidArgumentError as exc:   # a typo in ANYCCL_TUNING: said, and the defaults shown
        lines.append(f"  {exc}")
        rows = [(t.key, t.default, False, t.what) for t in tuning.TABLE.values()]
    for key, amount, overridden, what in rows:
        shown = tuning.format_value(key, amount) + (" (ANYCCL_TUNING)" if overridden else "")
        lines.append(f"  {key:<28} {shown:<18} {what}")
    lines += auto_routes()
    return "\n".join(lines)


def auto_routes() -> list[str]:
    """What the ipc `auto` policy follows here: the table in force for a job over every visible
    GPU and where it came from, then every measured table known (the cache's, the shipped)."""
    from ..backends.ipc import routes

    lines = ["\nipc auto policy (per-rank sizes that run on each kernel; every other size on "
             "NCCL; `anyccl tune` measures this machine):"]
    from .. import gpu

    count = _try(gpu.device_count, 0)
    if count >= 2:
        shape = _try(lambda: routes.shape_of([routes.gpu_identity(d) for d in range(count)]))
        if shape is not None:
            found = _try(lambda: routes.lookup(shape))
            lines.append(f"  in force for {count} ranks here: "
                         + (found.source if found else "unknown (the lookup failed)"))
            lines += [f"    {line}" for line in (found.describe() if found else [])]
    for path, kind in ((routes.cache_file(), "measured here"), (routes.SHIPPED, "shipped")):
        try:
            tables = routes.read_tables(path)
        except Exception as exc:  # noqa: BLE001 - info reports what it can
            lines.append(f"  {path} ({kind}): {exc}")
            continue
        lines.append(f"  {path} ({kind}): {len(tables)} table{'s' if len(tables) != 1 else ''}")
        for table in tables:
            shape = routes.Shape(**table["shape"])
            lines.append(f"    {shape} ({table.get('measured', 'date unknown')})")
            described = routes.Routes.from_json(table["routes"], str(path)).describe()
            lines += [f"      {line}" for line in described or ["every op on NCCL"]]
    return lines


def _address() -> str:
    from ..netaddr import named_interface, reachable_address

    name = named_interface()
    how = f"interface {name}" if name else "the hostname's address, else the first interface"
    return f"{reachable_address()} ({how})"


def _cuda_calls() -> str:
    from .. import gpu

    return gpu.calls_status()


def torch_backend() -> str:
    """Whether init_process_group("anyccl") works here, as `anyccl info` says it."""
    from importlib.metadata import entry_points

    if importlib.util.find_spec("torch") is None:
        return "not available: torch is not installed"
    hooked = any(e.value.startswith("anyccl.") for e in entry_points(group="torch.backends"))
    autoload = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"
    if hooked and autoload:
        return ('"anyccl" is registered when torch is imported '
                '(init_process_group("anyccl"))')
    why = ("TORCH_DEVICE_BACKEND_AUTOLOAD=0" if hooked else
           "this installation has no torch.backends entry point")
    return f'"anyccl" is registered by `import anyccl.torch` ({why})'

