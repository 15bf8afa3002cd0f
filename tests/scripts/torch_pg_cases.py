"""The process-group cases torch's own suite caught on anyccl, run on one backend; each rank
saves what it got. Usage: torch_pg_cases.py BACKEND WORLD_SIZE PORT OUT_DIR"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, backend: str, world_size: int, port: int, out_dir: str) -> None:
    if backend == "anyccl":
        import anyccl.torch  # noqa: F401
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=20))
    n, got = world_size, {}

    # every message of a batch posted before any is waited for: a ring in both directions
    sends = [torch.full((4,), float(rank * 10 + k)) for k in range(2)]
    recvs = [torch.empty(4) for _ in range(2)]
    ops = [dist.P2POp(dist.irecv, recvs[0], (rank - 1) % n, tag=1),
           dist.P2POp(dist.irecv, recvs[1], (rank + 1) % n, tag=2),
           dist.P2POp(dist.isend, sends[0], (rank + 1) % n, tag=1),
           dist.P2POp(dist.isend, sends[1], (rank - 1) % n, tag=2)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    got["batch"] = torch.stack(recvs)

    # coalesced all_gather: output_lists[r][i] is rank r's tensor i
    inputs = [torch.full((2,), float(rank)), torch.arange(3.0) + rank]
    outputs = [[torch.empty_like(t) for t in inputs] for _ in range(n)]
    dist.all_gather_coalesced(outputs, inputs)
    got["coalesced"] = [torch.cat(o) for o in outputs]

    # sparse all_reduce (SUM): entries every rank has, and one only this rank has
    indices = torch.tensor([[0, rank + 1], [1, 0]])
    sparse = torch.sparse_coo_tensor(indices, torch.tensor([1.0, float(rank + 1)]), (n + 1, 2))
    dist.all_reduce(sparse)
    got["sparse"] = sparse.to_dense()

    # a receive from any rank names its sender
    if rank == 0:
        senders = []
        for _ in range(n - 1):
            t = torch.empty(1)
            senders.append(dist.recv(t))
            assert t.item() == senders[-1] * 100
        got["senders"] = sorted(senders)
    else:
        dist.send(torch.tensor([rank * 100.0]), 0)
    dist.barrier()
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))

    # a barrier one rank never reaches: torch's words for a timeout, and anyccl's detail
    group = dist.new_group(list(range(n)), timeout=timedelta(seconds=1))
    if rank == 1:
        try:
            dist.barrier(group)
            message = "no timeout"
        except Exception as exc:  # noqa: BLE001 - whatever the backend raises
            message = str(exc)
        with open(os.path.join(out_dir, "timeout.txt"), "w") as f:
            f.write(message)
    else:
        import time

        time.sleep(3)
    os._exit(0)   # the group a rank left behind cannot be torn down collectively


if __name__ == "__main__":
    backend, world_size, port, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4]
    mp.start_processes(run, args=(backend, world_size, port, out_dir), nprocs=world_size,
                       start_method="spawn")
