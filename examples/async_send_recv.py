"""Blocking and non-blocking point-to-point, and their gotchas.

    anyccl run -n 2 examples/async_send_recv.py
    anyccl run -n 2 examples/async_send_recv.py --device cuda   # CuPy arrays on GPUs (nccl)

1. send/recv block: recv returns once the data is in the array.
2. isend/irecv return a Work at once; compute overlaps the transfer; read the array only after
   wait() (or once is_completed() says so: polled here).
3. The classic hang, a recv that no rank ever sends to, is turned into a clear error: anyccl's
   timeout (0.5 s here, set on purpose just before it) names the rank, the op and what it
   waited for. On GPUs a call returns once queued on the stream, so the wait is where the
   timeout shows.
"""

import argparse
import sys
import time

import numpy as np

import anyccl

parser = argparse.ArgumentParser()
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
args = parser.parse_args()
comm = anyccl.init("nccl" if args.device == "cuda" else None)
if args.device == "cuda":
    import cupy as xp  # the same code on this rank's GPU

    xp.cuda.Device(comm.device).use()
else:
    xp = np
if comm.size < 2:
    sys.exit("async_send_recv needs 2 ranks: anyccl run -n 2 examples/async_send_recv.py")
ok = True
n = 1 << 20

# 1. blocking
if comm.rank == 0:
    comm.send(xp.arange(n, dtype=np.float64), dst=1)
elif comm.rank == 1:
    got = xp.empty(n)
    comm.recv(got, src=0)
    ok &= bool(xp.array_equal(got, xp.arange(n)))
    print(f"rank 1: blocking recv got {got[:3]} ... {got[-1]}", flush=True)

# 2. non-blocking, with compute in between and is_completed polling
if comm.rank in (0, 1):
    peer = 1 - comm.rank
    outgoing = xp.full(n, comm.rank + 1.0)
    incoming = xp.zeros(n)
    send = comm.isend(outgoing, dst=peer, tag=5)
    recv = comm.irecv(incoming, src=peer, tag=5)
    t0 = time.perf_counter()
    busy = float(xp.sum(xp.sqrt(xp.arange(2_000_000, dtype=np.float64))))  # overlapped work
    polls = 0
    while not recv.is_completed():
        polls += 1
        time.sleep(0.0005)
    send.wait()
    recv.wait()
    ok &= bool(xp.all(incoming == peer + 1.0))
    print(f"rank {comm.rank}: irecv done after compute ({busy:.3g}) and {polls} polls in "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms; got {incoming[0]}", flush=True)

# 3. the hang that isn't: nobody sends tag 99 to rank 0 (a timeout breaks the communicator, so
# this comes last)
comm.barrier()
if comm.rank == 0:
    comm.timeout_s = 0.5   # from here on: the deliberate hang fails fast
    try:
        if args.device == "cuda":  # queued at once; the wait is what times out
            comm.irecv(xp.zeros(4), src=1, tag=99).wait(timeout=0.5)
        else:
            comm.recv(np.zeros(4), src=1, tag=99)
        ok = False
    except anyccl.TimeoutError as exc:
        print("rank 0: the recv with no matching send failed as it should:\n  "
              + str(exc).splitlines()[0], flush=True)
    else:
        print("rank 0: expected a timeout", flush=True)
else:
    # stay until rank 0 is done: its close() ends this receive, as a peer that leaves
    comm.timeout_s = 60
    try:
        comm.recv(np.zeros(1), src=0, tag=100)
        ok = False
    except (anyccl.PeerLostError, anyccl.TimeoutError):
        pass

print(f"rank {comm.rank}: {'OK' if ok else 'WRONG'}", flush=True)
comm.close()
sys.exit(0 if ok else 1)
