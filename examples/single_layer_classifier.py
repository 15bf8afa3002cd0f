"""A one-layer classifier whose loss is computed across ranks, as the torch.distributed tutorial
does: rank 0 makes the weights and broadcasts them asynchronously, every rank scores its own
slice of scikit-learn's digits (shipped with the package: no download) with a log-softmax loss,
and the per-rank sums are reduced to rank 0, which checks them against the loss of one process
over the union of the slices.

    anyccl run -n 4 examples/single_layer_classifier.py
    anyccl run -n 2 examples/single_layer_classifier.py --device cuda   # CuPy on the GPUs (nccl)
"""

import argparse
import sys

import numpy as np
from sklearn.datasets import load_digits

import anyccl

parser = argparse.ArgumentParser()
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
args = parser.parse_args()
comm = anyccl.init("nccl" if args.device == "cuda" else None)
if args.device == "cuda":
    import cupy as xp  # the same code, on this rank's GPU

    xp.cuda.Device(comm.device).use()
else:
    xp = np
digits = load_digits()
x = xp.asarray(digits.data / 16.0)
y = xp.asarray(digits.target)

weights = xp.empty((64, 10))
bias = xp.empty(10)
if comm.rank == 0:
    rng = np.random.default_rng(1)
    weights[...] = xp.asarray(rng.normal(0, 0.1, weights.shape))
    bias[...] = xp.asarray(rng.normal(0, 0.1, bias.shape))
works = [comm.broadcast(weights, 0, async_op=True), comm.broadcast(bias, 0, async_op=True)]

mine = xp.arange(comm.rank, len(x), comm.size)    # this rank's slice of the data
local_x, local_y = x[mine], y[mine]                # (prepared while the weights travel)
for w in works:
    w.wait()                                       # weights must have arrived before use


def log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))


def nll_sum(xs, ys):
    return -log_softmax(xs @ weights + bias)[xp.arange(len(ys)), ys].sum()


totals = xp.stack([nll_sum(local_x, local_y), xp.asarray(float(len(local_y)))])
print(f"rank {comm.rank}: {len(local_y)} samples, loss sum {float(totals[0]):.6f}", flush=True)
comm.reduce(totals, dst=0)                         # rank 0: sums over all ranks
ok = True
if comm.rank == 0:
    distributed = float(totals[0] / totals[1])
    single = float(nll_sum(x, y)) / len(y)
    ok = abs(distributed - single) <= 1e-12 * abs(single) and int(totals[1]) == len(y)
    print(f"mean loss over {int(totals[1])} samples on {comm.size} ranks: {distributed:.12f}; "
          f"one process: {single:.12f}: {'OK' if ok else 'WRONG'}", flush=True)
ok = bool(comm.all_gather_object(ok)[0])
comm.close()
sys.exit(0 if ok else 1)
