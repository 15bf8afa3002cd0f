"""Every collective on small images, as the torch.distributed tutorial pictures them: each rank
holds a disk or a square, runs the collective, saves a PNG of what it held before and after
(one file per collective and rank), and checks the result against what every rank's images
must give.

    anyccl run -n 4 examples/collectives_tour.py [--out DIR]   # default: a new temporary DIR
    anyccl run -n 2 examples/collectives_tour.py --device cuda   # CuPy arrays on the GPUs (nccl)

(`anyccl viz all -n 4` draws all ranks in one picture.)
"""

import argparse
import os
import sys
import tempfile

import numpy as np

import anyccl
from anyccl.tools.viz import OPS, draw, image, run_collective

parser = argparse.ArgumentParser()
parser.add_argument("--out", help="where the PNGs go (default: a new temporary directory)")
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
args = parser.parse_args()

comm = anyccl.init("nccl" if args.device == "cuda" else None)
r, n, root = comm.rank, comm.size, 0
if args.out is None:   # rank 0 makes one directory for everyone
    args.out = comm.broadcast_object(tempfile.mkdtemp(prefix="anyccl-tour-") if r == 0 else None,
                                     src=0)
os.makedirs(args.out, exist_ok=True)


def expected(op):
    """What rank r must hold after `op` (list of images), from every rank's inputs."""
    everyone = [image(j) for j in range(n)]
    if op == "all_reduce":
        return [sum(everyone)]
    if op == "reduce":
        return [sum(everyone) if r == root else image(r)]
    if op == "broadcast":
        return [image(root)]
    if op == "all_gather":
        return everyone
    if op == "gather":
        return everyone if r == root else [image(r)]   # the others keep their image
    if op == "scatter":
        return [image(root, salt=r + 1)]
    if op == "reduce_scatter":
        return [sum(image(j, salt=r) for j in range(n))]
    if op == "all_to_all":
        return [image(j, salt=r) for j in range(n)]
    raise ValueError(op)


ok = True
for op in OPS:
    before, after = run_collective(comm, op, device=args.device)
    want = expected(op)
    right = len(after) == len(want) and all(np.array_equal(a, e) for a, e in zip(after, want))
    ok &= right
    path = os.path.join(args.out, f"{op}-rank{r}.png")
    draw([(before, after)], op, f"{op}, rank {r} of {n}", path)
    print(f"rank {r}: {op:<15} {'OK' if right else 'WRONG'}  {path}", flush=True)
comm.close()
sys.exit(0 if ok else 1)
