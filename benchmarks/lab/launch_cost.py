"""Host time of one cuLaunchKernel through anyccl's compiled driver calls, by the size of the
kernel's parameter block (8, 128 and 368 bytes: the ipc kernels' block is 368) and threads per
block, beside the ipc backend's own low-latency all_reduce kernel, a tiny torch op, torch's stream
lookup and a whole replayed `comm.all_reduce`, on one GPU (batches of 400 calls with the GPU drained
in between, median of 5 rounds).

    python3 benchmarks/lab/launch_cost.py
"""

import ctypes
import statistics

import torch
from eager_host_cost import per_call  # (this folder: scripts run from it find each other)

import anyccl
from anyccl import gpu
from anyccl.backends.ipc import compiler

SOURCE = r"""
struct Big { unsigned long long w[46]; };
extern "C" __global__ void big(Big a) { if (a.w[0] == 12345) *(int*)a.w[1] = 1; }
struct Mid { unsigned long long w[16]; };
extern "C" __global__ void mid(Mid a) { if (a.w[0] == 12345) *(int*)a.w[1] = 1; }
extern "C" __global__ void small(unsigned long long p) { if (p == 12345) *(int*)p = 1; }
"""


class Big(ctypes.Structure):
    _fields_ = [("w", ctypes.c_uint64 * 46)]


class Mid(ctypes.Structure):
    _fields_ = [("w", ctypes.c_uint64 * 16)]


class Small(ctypes.Structure):
    _fields_ = [("p", ctypes.c_uint64)]


def main() -> None:
    torch.cuda.set_device(0)
    torch.cuda.init()
    core = gpu._core
    if core is None:
        raise SystemExit("the CUDA core (anyccl/_cudacore.c) is not built or found no driver")
    major, minor = gpu.compute_capability(0)
    module = gpu.load_module(compiler._compile(SOURCE, f"sm_{major}{minor}"))
    stream = torch.cuda.current_stream().cuda_stream
    calls = {}
    for name, block in (("big", Big), ("mid", Mid), ("small", Small)):
        function = gpu.module_function(module, name)
        for threads in (32, 1024):
            k = gpu.KernelLaunch(function, 1, threads, block())
            calls[f"{name} ({ctypes.sizeof(block)} B params), {threads} threads"] = (
                lambda k=k: core.launch(k.function, k.blocks, k.threads, stream, k.params))
    comm = anyccl.init(backend="ipc")
    x = torch.ones(2, device="cuda")
    comm.all_reduce(x)
    comm.all_reduce(x)   # the second call made the plan: its operation is one kernel
    ll = next(iter(comm._plans._plans.values())).enqueue
    calls[f"ipc low-latency all_reduce kernel ({ctypes.sizeof(ll.args)} B params), "
          f"{ll.threads} threads"] = (
        lambda: core.launch(ll.function, ll.blocks, ll.threads, stream, ll.params))
    calls["x.add_(0)"] = lambda: x.add_(0)
    calls["torch.cuda.current_stream()"] = torch.cuda.current_stream
    calls["comm.all_reduce(x), replayed"] = lambda: comm.all_reduce(x)
    rows: dict[str, list[float]] = {}
    for _ in range(5):
        for name, fn in calls.items():
            rows.setdefault(name, []).append(per_call(fn, batches=20))
    print(f"# {torch.cuda.get_device_name()}, host us per call, median of 5 rounds\n"
          "| call | us |\n|---|---:|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.2f} |")
    comm.close()


if __name__ == "__main__":
    main()
