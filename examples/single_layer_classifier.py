"""A one-layer classifier whose loss is computed across ranks, as the torch.distributed tutorial
does: rank 0 makes the weights and broadcasts them asynchronously, every rank scores its own
slice of scikit-learn's digits (shipped with the package: no download) with a log-softmax loss,
and the per-rank sums are reduced to rank 0, which checks them against the loss of one process
over the union of the slices.

    anyccl run -n 4 examples/single_layer_classifier.py
"""

import sys

import numpy as np
from sklearn.datasets import load_digits

import anyccl

comm = anyccl.init()
digits = load_digits()
x = digits.data / 16.0
y = digits.target

weights = np.empty((64, 10))
bias = np.empty(10)
if comm.rank == 0:
    rng = np.random.default_rng(1)
    weights[...] = rng.normal(0, 0.1, weights.shape)
    bias[...] = rng.normal(0, 0.1, bias.shape)
works = [comm.broadcast(weights, 0, async_op=True), comm.broadcast(bias, 0, async_op=True)]

mine = np.arange(comm.rank, len(x), comm.size)    # this rank's slice of the data
local_x, local_y = x[mine], y[mine]                # (prepared while the weights travel)
for w in works:
    w.wait()                                       # weights must have arrived before use


def log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def nll_sum(xs, ys):
    return -log_softmax(xs @ weights + bias)[np.arange(len(ys)), ys].sum()


totals = np.array([nll_sum(local_x, local_y), len(local_y)])
print(f"rank {comm.rank}: {len(local_y)} samples, loss sum {totals[0]:.6f}", flush=True)
comm.reduce(totals, dst=0)                         # rank 0: sums over all ranks
ok = True
if comm.rank == 0:
    distributed = totals[0] / totals[1]
    single = nll_sum(x, y) / len(y)
    ok = abs(distributed - single) <= 1e-12 * abs(single) and int(totals[1]) == len(y)
    print(f"mean loss over {int(totals[1])} samples on {comm.size} ranks: {distributed:.12f}; "
          f"one process: {single:.12f}: {'OK' if ok else 'WRONG'}", flush=True)
ok = bool(comm.all_gather_object(ok)[0])
comm.close()
sys.exit(0 if ok else 1)
