"""One rank of an MpiRankPool (tests/harness.py): started by mpiexec, it joins anyccl on the mpi
backend, connects back to the test process and runs the functions it sends."""

import os
import sys
from multiprocessing.connection import Client

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import run_setup, serve  # noqa: E402

import anyccl  # noqa: E402

run_setup()
comm = anyccl.init()
conn = Client((sys.argv[1], int(sys.argv[2])), authkey=bytes.fromhex(
    os.environ["ANYCCL_TEST_AUTHKEY"]))
conn.send(comm.rank)
serve(conn, comm)
