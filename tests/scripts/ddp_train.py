"""Train a small model with torch's DistributedDataParallel on the process-group backend named
on the command line ("gloo" or "anyccl"), on CPU, and save every rank's final weights. The
torch-backend tests run it on both and compare.

    python ddp_train.py BACKEND WORLD_SIZE PORT OUT_DIR [VARIANT,...]
    torchrun ... ddp_train.py BACKEND torchrun - OUT_DIR [VARIANT,...]   (one rank per process)

VARIANTs, each a fresh model trained in the same process group, results saved under
"VARIANT/...": plain, unused (find_unused_parameters, a layer left out on odd steps), no_sync
(gradient accumulation over two micro-batches), fp16_hook (the fp16 compression comm hook),
static_graph, functional (torch's functional and object collectives after plain training),
fsdp2 (the model sharded with FSDP2's fully_shard instead of DDP; full weights saved).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 12


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 32)
        self.spare = torch.nn.Linear(32, 32)
        self.last = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        h = torch.relu(self.first(x))
        if not skip:
            h = torch.relu(self.spare(h))
        return self.last(h)


def main(rank: int, backend: str, world_size: int, port: int | None, out_dir: str,
         variants: list[str]) -> None:
    if port is None:   # started by torchrun: rank, world and rendezvous from its environment
        dist.init_process_group(backend)
    else:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        # "anyccl" needs no import: installing anyccl registers it when torch is imported
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    results = {}
    for variant in variants:
        for key, value in train(rank, world_size, variant).items():
            results[f"{variant}/{key}"] = value
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    # ending through the interpreter's shutdown lets gloo's worker thread free a finished Work
    # while the interpreter finalizes; the thread is ended as it takes the GIL and libstdc++
    # aborts ("terminate called without an active exception", about 1 exit in 10 with gloo
    # alone): the work is done and saved, so leave at once.
    os._exit(0)


def train_fsdp2(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model()
    for layer in (model.first, model.spare, model.last):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {name: value.full_tensor().detach().clone()
            for name, value in model.state_dict().items()}


def train(rank: int, world_size: int, variant: str) -> dict:
    if variant == "fsdp2":
        return train_fsdp2(rank)
    torch.manual_seed(0)
    model = Model()
    ddp = DDP(model, find_unused_parameters=variant == "unused",
              static_graph=variant == "static_graph")
    if variant == "fp16_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        skip = variant == "unused" and step % 2 == 1
        optimizer.zero_grad()
        if variant == "no_sync":
            with ddp.no_sync():
                torch.nn.functional.mse_loss(ddp(x[:4]), y[:4]).backward()
            torch.nn.functional.mse_loss(ddp(x[4:]), y[4:]).backward()
        else:
            torch.nn.functional.mse_loss(ddp(x, skip), y).backward()
        optimizer.step()
    results = {name: p.detach().clone() for name, p in model.named_parameters()}
    if variant == "functional":
        t = torch.arange(4, dtype=torch.float32) + rank
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results["all_reduce_max"] = t
        gathered = torch.empty(4 * world_size)
        dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank)))
        results["all_gather_into_tensor"] = gathered
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, torch.arange(2.0 * world_size) * (rank + 1))
        results["reduce_scatter_tensor"] = out
        objects = [None] * world_size
        dist.all_gather_object(objects, {"rank": rank})
        results["all_gather_object"] = objects
        box = [f"from {rank}"]
        dist.broadcast_object_list(box, src=world_size - 1)
        results["broadcast_object_list"] = box
        a2a = torch.empty(world_size)
        dist.all_to_all_single(a2a, torch.arange(float(world_size)) + 10 * rank)
        results["all_to_all_single"] = a2a
        sends = [(rank + j) % 3 + 1 for j in range(world_size)]          # rows to rank j
        receives = [(j + rank) % 3 + 1 for j in range(world_size)]       # rows from rank j
        rows = torch.cat([torch.full((c, 2), 10.0 * rank + j) for j, c in enumerate(sends)])
        got = torch.empty(sum(receives), 2)
        dist.all_to_all_single(got, rows, receives, sends)
        results["all_to_all_single_uneven"] = got
        if rank == 0:   # from any source: every other rank's message, the sender named
            heard = []
            for _ in range(2 * (world_size - 1)):
                box = torch.empty(3)
                heard.append((dist.recv(box, tag=3), box.tolist()))
            results["recv_anysource"] = sorted(heard)
        else:
            for k in range(2):
                dist.send(torch.full((3,), 10.0 * rank + k), dst=0, tag=3)
        dist.barrier()
    return results


if __name__ == "__main__":
    variants = (sys.argv[5] if len(sys.argv) > 5 else "plain").split(",")
    if sys.argv[2] == "torchrun":
        main(int(os.environ["RANK"]), sys.argv[1], int(os.environ["WORLD_SIZE"]), None,
             sys.argv[4], variants)
    backend, world_size, port, out_dir = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                          sys.argv[4])
    mp.spawn(main, args=(backend, world_size, port, out_dir, variants), nprocs=world_size)
