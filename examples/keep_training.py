"""Data-parallel training that loses a rank and goes on: a PyTorch MLP on scikit-learn's digits,
its gradients averaged over anyccl; one rank is killed mid-run, and the others shrink the
communicator, re-shard the data over themselves and finish.

    anyccl run --keep-going -n 4 examples/keep_training.py [--kill-rank 2] [--kill-step 30]
    anyccl run --keep-going --replace -n 4 examples/keep_training.py --grow-step 60

With `--replace` the launcher starts a new process in place of the dead rank; its
`anyccl.init()` waits until the survivors grow the communicator (`comm.grow()`, here at step
`--grow-step`), then it takes rank 0's step and weights and trains with the others.

What the program does when a collective fails (the part a training loop must own):
- the communicator: `comm.shrink()` on every survivor gives the communicator of the survivors;
- the data: each survivor takes its slice of the training set for the new number of ranks;
- the state: a step is taken only after its gradients were averaged on every rank, but a rank
  may have finished the failed all_reduce (and its step) while another did not; so every rank
  keeps the weights from before its last step, the survivors agree on the last step all of them
  finished (an all_reduce MIN), a rank that went one step further goes back, and rank 0's weights
  are broadcast so that all survivors continue from the same bits.

At the end every survivor checks that its weights are bit-identical to the others' and that the
test accuracy is that of a trained model; exits non-zero if not.
"""

import argparse
import os
import signal
import sys

import numpy as np
import torch
from sklearn.datasets import load_digits

import anyccl

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--lr", type=float, default=0.5)
parser.add_argument("--kill-rank", type=int, default=2, help="the rank that dies (-1: none)")
parser.add_argument("--kill-step", type=int, default=30)
parser.add_argument("--grow-step", type=int, default=-1,
                    help="the step at which the survivors admit the processes started in place "
                    "of lost ranks (`anyccl run --replace`); -1: never")
args = parser.parse_args()

torch.manual_seed(0)
comm = anyccl.init()
newcomer = comm.grown_from is not None   # started in place of a lost rank: joined by growing
start_rank, started = comm.rank, comm.size
digits = load_digits()
x_all = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y_all = torch.tensor(digits.target)
order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
train, test = order[:1400], order[1400:]
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
params = list(model.parameters())
flat = torch.zeros(sum(p.numel() for p in params))


def my_slice():
    """This rank's slice of the training set, for the communicator's current size."""
    return train[comm.rank::comm.size]


def snapshot():
    return [p.detach().clone() for p in params]


def restore(weights):
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)


def recover(step: int, before: list) -> int:
    """After a failed collective: shrink, agree on the step to go on from, same weights."""
    global comm
    old, comm = comm, comm.shrink()
    old.close()
    done = np.array([step])                  # the steps this rank finished
    comm.all_reduce(done, op="min")
    if step > int(done[0]):                  # this rank took the step the others could not
        restore(before)
    with torch.no_grad():
        for p in params:
            comm.broadcast(p, 0)
    print(f"rank {start_rank}: lost rank(s) {sorted(comm.shrunk_from['lost'])}; going on as "
          f"rank {comm.rank} of {comm.size} from step {int(done[0])}", flush=True)
    return int(done[0])


def take_rank_0s(step: int) -> int:
    """Every rank of a grown communicator goes on from rank 0's step and weights."""
    now = np.array([step])
    comm.broadcast(now, 0)
    with torch.no_grad():
        for p in params:
            comm.broadcast(p, 0)
    return int(now[0])


def admit(step: int) -> int:
    """Grow back to as many ranks as the job started with: the processes started in place of
    the lost ones wait in their anyccl.init() until this."""
    global comm
    old, comm = comm, comm.grow(started - comm.size, timeout=120)
    old.close()
    print(f"rank {start_rank}: admitted rank(s) {comm.grown_from['joined']} at step {step}; "
          f"now rank {comm.rank} of {comm.size}", flush=True)
    return take_rank_0s(step)


step = take_rank_0s(0) if newcomer else 0
before = snapshot()
if newcomer:
    print(f"new process: joined as rank {comm.rank} of {comm.size} at step {step}", flush=True)
while step < args.steps:
    if start_rank == args.kill_rank and step == args.kill_step and not newcomer:
        os.kill(os.getpid(), signal.SIGKILL)
    if step == args.grow_step and comm.size < started:
        step = admit(step)
        before = snapshot()
    idx = my_slice()
    loss = torch.nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
    model.zero_grad()
    loss.backward()
    torch.cat([p.grad.flatten() for p in params], out=flat)
    try:
        comm.all_reduce(flat)
    except anyccl.AnycclError:
        step = recover(step, before)
        continue
    flat /= comm.size
    before = snapshot()
    with torch.no_grad():
        offset = 0
        for p in params:
            p -= args.lr * flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    step += 1

mine = torch.cat([p.detach().flatten() for p in params]).numpy().astype(np.float64)
lo, hi = mine.copy(), mine.copy()
comm.all_reduce(lo, op="min")
comm.all_reduce(hi, op="max")
identical = bool(np.array_equal(lo, mine) and np.array_equal(hi, mine))
with torch.no_grad():
    accuracy = float((model(x_all[test]).argmax(1) == y_all[test]).float().mean())
who = "new process" if newcomer else f"rank {start_rank}"
print(f"{who} (now {comm.rank} of {comm.size}): {args.steps} steps, test accuracy "
      f"{accuracy:.3f}, weights identical on every survivor: {identical}", flush=True)
comm.close()
sys.exit(0 if identical and accuracy > 0.85 else 1)
