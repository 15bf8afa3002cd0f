"""Where the host time of one small GPU all_reduce goes (one process, one GPU): the CUDA calls
anyccl makes per operation through the runtime and the driver bindings, torch's stream lookup,
and a profile of anyccl.all_reduce on 8 bytes, on the backend named by the first argument
(nccl by default, or ipc)."""

import cProfile
import pstats
import sys
import time

import torch

import anyccl
from anyccl import gpu

backend = sys.argv[1] if len(sys.argv) > 1 else "nccl"
comm = anyccl.init(backend=backend)
x = torch.zeros(2, device=f"cuda:{comm.device}")
event, stream = gpu.new_event(comm.device), torch.cuda.current_stream().cuda_stream
rt, drv = gpu._rt(), gpu._drv()


def per_call(label, fn, n=20000):
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    print(f"{label:<40} {(time.perf_counter() - t) / n * 1e6:7.2f} us", flush=True)


per_call("cudart cudaEventRecord", lambda: rt.cudaEventRecord(event, stream))
per_call("driver cuEventRecord", lambda: drv.cuEventRecord(event, stream))
per_call("cudart cudaStreamWaitEvent", lambda: rt.cudaStreamWaitEvent(stream, event, 0))
per_call("driver cuStreamWaitEvent", lambda: drv.cuStreamWaitEvent(stream, event, 0))
per_call("torch.cuda.current_stream", lambda: torch.cuda.current_stream(comm.device).cuda_stream)
per_call(f"anyccl all_reduce 8 B ({backend})", lambda: comm.all_reduce(x), 5000)
torch.cuda.synchronize()
cProfile.run("for _ in range(3000): comm.all_reduce(x)", "/tmp/anyccl.prof")
torch.cuda.synchronize()
pstats.Stats("/tmp/anyccl.prof").sort_stats("tottime").print_stats(25)
comm.close()
