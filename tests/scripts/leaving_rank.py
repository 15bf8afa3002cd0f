"""Rank 1 leaves after a first all_reduce, as argv[1] says (raise: an uncaught exception;
exit: sys.exit(3); close: closes its communicator and ends normally); the others go on to a
second all_reduce and print "LOST <rank> <seconds>" when they learn that rank 1 is gone."""

import sys
import time

import numpy as np

import anyccl

mode = sys.argv[1]
comm = anyccl.init()
x = np.ones(1000, np.float32)
comm.all_reduce(x)
if comm.rank == 1:
    if mode == "raise":
        raise ValueError("rank 1 gives up")
    if mode == "exit":
        sys.exit(3)
    comm.close()
    sys.exit(0)
start = time.monotonic()
try:
    comm.all_reduce(x)
    print(f"rank {comm.rank}: NOT LOST", flush=True)
except anyccl.PeerLostError as exc:
    print(f"LOST {exc.lost_rank} {time.monotonic() - start:.2f}", flush=True)
    print(exc, flush=True)
