"""A rank that records its pid, then behaves as argv says:
  ok                     finish normally
  exit RANK CODE         rank RANK exits with CODE after a few collectives; others keep going
  kill RANK              rank RANK kills itself with SIGKILL mid-loop
  forever                every rank loops on collectives until stopped
  chatty                 every rank prints 300 lines in pieces and ends on a line without newline
  slow-exit RANK CODE    rank RANK closes its communicator, and exits with CODE half a second
                         later: the others lose it first and fail before it does
  refuse RANK            rank RANK passes an array whose elements share memory to
                         all_reduce and raises the refusal
                         0.2 s later: every rank raises, the others usually first
  stall RANK             rank RANK stops calling collectives (it sleeps) after a few: the
                         others time out waiting for it (run with a short ANYCCL_TIMEOUT)
"""

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import anyccl

mode, pid_dir = sys.argv[1], Path(sys.argv[2])
comm = anyccl.init()
(pid_dir / f"rank{comm.rank}.pid").write_text(str(os.getpid()))
print(f"hello from rank {comm.rank}", flush=True)
if mode == "chatty":
    for i in range(300):
        print(comm.rank, "line", i, "x" * 30)  # unbuffered: several writes per line
    print(f"rank {comm.rank} to stderr", file=sys.stderr)
    sys.stdout.write(f"last words of rank {comm.rank}")  # no newline, and the rank exits
    comm.close()
    sys.exit(0)
x = np.ones(1000, np.float32)
for step in range(10**9):
    if mode == "ok" and step == 20:
        break
    if mode == "exit" and comm.rank == int(sys.argv[3]) and step == 5:
        sys.exit(int(sys.argv[4]))
    if mode == "slow-exit" and comm.rank == int(sys.argv[3]) and step == 5:
        comm.close()
        time.sleep(0.5)
        sys.exit(int(sys.argv[4]))
    if mode == "kill" and comm.rank == int(sys.argv[3]) and step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "refuse" and comm.rank == int(sys.argv[3]) and step == 5:
        try:
            comm.all_reduce(np.lib.stride_tricks.as_strided(   # elements share memory: refused
                np.ones(4, np.float32), (4, 4), (0, 4)))
        except anyccl.InvalidArgumentError:
            time.sleep(0.2)     # the others raise first, told of the refusal (the launcher
            raise               # waits up to 1 s for the rank they name)
    if mode == "stall" and comm.rank == int(sys.argv[3]) and step == 5:
        time.sleep(60)          # the launcher stops it long before
    comm.all_reduce(x)
    if mode == "forever":
        time.sleep(0.01)
comm.close()
