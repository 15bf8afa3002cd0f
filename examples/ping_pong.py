"""Ping-pong between two ranks, as in the ARK tutorial: rank 0 sends an fp16 tensor to rank 1,
which sends it straight back; the round trip must be exact (max error 0).

    anyccl run -n 2 examples/ping_pong.py                  # CPU ranks (NumPy)
    anyccl run -n 2 examples/ping_pong.py --device cuda    # GPU0 -> GPU1 -> GPU0 (torch, nccl)

Ranks beyond the first two only join the final barrier.
"""

import argparse
import sys
import time

import numpy as np

import anyccl

parser = argparse.ArgumentParser()
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
parser.add_argument("--elements", type=int, default=1 << 20)
parser.add_argument("--rounds", type=int, default=10)
args = parser.parse_args()

if args.device == "cuda":
    import torch

    comm = anyccl.init(backend="nccl")           # GPU point-to-point needs NCCL up front
    dev = f"cuda:{comm.device}"
    make = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    host = lambda t: t.cpu().numpy()              # noqa: E731 (synchronises)
    empty = lambda: torch.empty(args.elements, dtype=torch.float16, device=dev)  # noqa: E731
else:
    comm = anyccl.init()
    make, host = np.array, np.asarray
    empty = lambda: np.empty(args.elements, np.float16)  # noqa: E731

if comm.size < 2:
    sys.exit("ping_pong needs 2 ranks: anyccl run -n 2 examples/ping_pong.py")

PING, PONG = 1, 2                                # tags: which way the message travels
worst = 0.0
if comm.rank in (0, 1):
    for r in range(args.rounds):
        data = np.random.default_rng(r).standard_normal(args.elements).astype(np.float16)
        if comm.rank == 0:
            x, back = make(data), empty()
            t0 = time.perf_counter()
            comm.send(x, dst=1, tag=PING)
            comm.recv(back, src=1, tag=PONG)
            result = host(back)
            elapsed = time.perf_counter() - t0
            worst = max(worst, float(np.max(np.abs(result.astype(np.float32) -
                                                   data.astype(np.float32)))))
            print(f"round {r}: {data.nbytes / 2**20:.1f} MiB there and back in "
                  f"{elapsed * 1e3:.2f} ms, max error {worst}", flush=True)
        else:
            x = empty()
            comm.recv(x, src=0, tag=PING)
            comm.send(x, dst=0, tag=PONG)
            host(x)
comm.barrier()
if comm.rank == 0:
    print(f"ping-pong over {comm.backend}: max error {worst}: "
          f"{'OK' if worst == 0 else 'WRONG'}", flush=True)
comm.close()
sys.exit(0 if worst == 0 else 1)
