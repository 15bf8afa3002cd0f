"""Data-parallel training of a small MLP on scikit-learn's digits (shipped with the package: no
download), in NumPy or PyTorch, over N ranks with anyccl.ddp.GradientAverager.

    anyccl run -n 4 examples/train_mlp.py [--epochs 60] [--backend shm|mpi]
    anyccl run -n 4 examples/train_mlp.py --torch    # torch autograd; reductions start in backward
    anyccl run -n 2 examples/train_mlp.py --torch --device cuda   # the same on GPUs (nccl)

Each rank trains on its own equal slice of the training set; the averaged gradient of the
slices is the full-batch gradient, so every rank ends with weights bit-identical to the other
ranks' and equal, within float tolerance, to single-process full-batch training on the union
(also computed here, on rank 0, as the check). Exits non-zero if either check fails.
"""

import argparse
import sys

import numpy as np
from sklearn.datasets import load_digits

import anyccl
from anyccl.ddp import GradientAverager

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=60)
parser.add_argument("--lr", type=float, default=0.5)
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--backend", default=None)
parser.add_argument("--torch", action="store_true", help="PyTorch model and autograd")
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the torch model lives (cuda: one GPU per rank, needs --torch)")
args = parser.parse_args()
if args.device == "cuda" and not args.torch:
    parser.error("--device cuda trains the PyTorch flavour: add --torch")

comm = anyccl.init(args.backend or ("nccl" if args.device == "cuda" else None))
digits = load_digits()
x_all = (digits.data / 16.0).astype(np.float64)
y_all = digits.target
order = np.random.default_rng(0).permutation(len(x_all))
n_train = (1400 // comm.size) * comm.size            # equal slices: the averages are exact
train, test = order[:n_train], order[1400:]


def init_weights():
    rng = np.random.default_rng(42)                  # the same start on every rank
    return [rng.normal(0, 0.1, (64, args.hidden)), np.zeros(args.hidden),
            rng.normal(0, 0.1, (args.hidden, 10)), np.zeros(10)]


def forward(w, x):
    h = np.tanh(x @ w[0] + w[1])
    logits = h @ w[2] + w[3]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    return h, p / p.sum(axis=1, keepdims=True)


def gradients(w, x, y):
    """Mean cross-entropy over (x, y) and its gradient."""
    h, p = forward(w, x)
    loss = -np.mean(np.log(p[np.arange(len(y)), y] + 1e-12))
    d = p.copy()
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    dh = (d @ w[2].T) * (1 - h * h)
    return loss, [x.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]


def accuracy(w, x, y):
    return float(np.mean(forward(w, x)[1].argmax(1) == y))


def progress(epoch, loss):
    if comm.rank == 0 and (epoch % 10 == 9 or epoch == args.epochs - 1):
        done = (epoch + 1) * 30 // args.epochs
        print(f"[{'#' * done}{'.' * (30 - done)}] epoch {epoch + 1:3d}/{args.epochs}  "
              f"loss (rank 0's slice) {loss:.4f}", flush=True)


def train_numpy(mine):
    weights = init_weights()
    grads = [np.zeros_like(w) for w in weights]
    averager = GradientAverager(comm, grads, bucket_mb=0.01)
    for epoch in range(args.epochs):
        loss, local = gradients(weights, x_all[mine], y_all[mine])
        for g, lg in zip(grads, local):
            g[...] = lg
        averager.average()                           # every rank: the full-batch gradient
        for w, g in zip(weights, grads):
            w -= args.lr * g
        progress(epoch, loss)
    return weights


def train_torch(mine):
    import torch

    device = f"cuda:{comm.device}" if args.device == "cuda" else "cpu"
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.from_numpy(w).to(device))
                                    for w in init_weights()])
    averager = GradientAverager.for_module(comm, model, bucket_mb=0.01)
    x = torch.from_numpy(x_all[mine]).to(device)
    y = torch.from_numpy(y_all[mine]).to(device)
    for epoch in range(args.epochs):
        w = list(model)
        logits = torch.tanh(x @ w[0] + w[1]) @ w[2] + w[3]
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()                              # buckets start during backward
        averager.wait()                              # .grad: the full-batch gradient
        with torch.no_grad():
            for p in model:
                p -= args.lr * p.grad
                p.grad.zero_()
        progress(epoch, loss.item())
    return [p.detach().cpu().numpy() for p in model]


mine = train[comm.rank::comm.size]
weights = train_torch(mine) if args.torch else train_numpy(mine)

# every rank holds the same bytes
fingerprints = comm.all_gather_object(b"".join(w.tobytes() for w in weights))
identical = all(f == fingerprints[0] for f in fingerprints)
ok = identical
if comm.rank == 0:
    single = init_weights()                          # the same training in one process
    for _ in range(args.epochs):
        _, g = gradients(single, x_all[train], y_all[train])
        for w, gw in zip(single, g):
            w -= args.lr * gw
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, single))
    ok &= gap < 1e-9
    acc = accuracy(weights, x_all[test], y_all[test])
    flavour = f"torch on {args.device}" if args.torch else "numpy"
    print(f"{comm.size} ranks ({comm.backend}, {flavour}): test accuracy {acc:.3f}; weights "
          f"identical on every rank: {identical}; largest "
          f"difference from single-process full-batch training: {gap:.2e}: "
          f"{'OK' if ok else 'WRONG'}", flush=True)
ok = comm.all_gather_object(ok)[0]
comm.close()
sys.exit(0 if ok else 1)
