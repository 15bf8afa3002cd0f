"""A torch.distributed tutorial-style script: spawn ranks, run each collective on CPU tensors,
save what every rank ends with. The compatibility test runs it as written (gloo) and with its
import line changed to anyccl.distributed, and compares the two outputs."""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPERATION = dist.ReduceOp.MAX


def main_process(rank, world_size, port, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(rank)
    results = {}

    image = torch.randint(0, 10, (8, 8)).float()
    dist.all_reduce(image, op=OPERATION)
    results["all_reduce_max"] = image.clone()

    total = torch.arange(12, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(total)
    results["all_reduce_sum"] = total

    loss = torch.tensor(float(rank) + 0.5)
    dist.reduce(loss, dst=0, op=dist.ReduceOp.SUM)
    if rank == 0:  # torch leaves other ranks' tensors unspecified (gloo writes partial sums)
        results["reduce"] = loss

    weights = torch.rand(5, 3) if rank == 0 else torch.zeros(5, 3)
    handle = dist.broadcast(tensor=weights, src=0, async_op=True)
    handle.wait()
    results["broadcast"] = weights

    gathered = [torch.zeros(4, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, torch.arange(4) + 10 * rank)
    results["all_gather"] = torch.stack(gathered)

    inputs = [torch.full((3,), float(rank * world_size + j)) for j in range(world_size)]
    output = torch.zeros(3)
    dist.reduce_scatter(output, inputs, op=OPERATION)
    results["reduce_scatter"] = output

    dist.barrier()
    results["rank"], results["world_size"] = dist.get_rank(), dist.get_world_size()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(main_process, args=(world_size, port, out_dir), nprocs=world_size)
