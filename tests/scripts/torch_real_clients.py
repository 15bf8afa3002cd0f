"""What torch's own utilities ask of a process group, run on one backend: the devices it declares
and its default device, distributed checkpoints (save, load, async_save), FSDP2 loading a full
state dict broadcast from rank 0, DTensor redistribution, the functional collectives and a
pipeline-parallel schedule. Each rank saves what it got.
Usage: torch_real_clients.py BACKEND WORLD_SIZE PORT OUT_DIR"""

import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, backend: str, world_size: int, port: int, out_dir: str) -> None:
    if backend == "anyccl":
        import anyccl.torch  # noqa: F401
    import torch.distributed._functional_collectives as fc
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    n, got = world_size, {}
    group = dist.group.WORLD

    # which devices the group serves: what DCP, FSDP2 and DeviceMesh ask
    got["device_types"] = sorted(d.type for d in group._device_types)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch deprecates the helper, not what it answers
        got["default_device"] = str(dist.distributed_c10d._get_pg_default_device())
    got["object_device"] = dist.distributed_c10d._get_object_coll_device(group)

    # a distributed checkpoint: save, load into another model, and the async save
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)     # each rank's own weights: a rank that saved another's is seen
    checkpoint = os.path.join(out_dir, "dcp")
    dcp.save(model.state_dict(), checkpoint_id=checkpoint)
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    got["dcp_loaded"] = [state[k].clone() for k in sorted(state)]
    later = os.path.join(out_dir, "dcp-async")
    dcp.async_save(model.state_dict(), checkpoint_id=later).result()
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=later)
    got["dcp_async_loaded"] = [state[k].clone() for k in sorted(state)]

    # FSDP2 loads a full state dict that only rank 0 holds, broadcast from it
    torch.manual_seed(1)
    full = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    full_sd = {k: v.clone() for k, v in full.state_dict().items()}
    torch.manual_seed(2 + rank)       # every rank starts from other weights
    sharded = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (n,))
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    given = {k: v.clone() for k, v in full_sd.items()} if rank == 0 else {}  # torch fills it in
    set_model_state_dict(sharded, given, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    loaded = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()   # collective
              for k, v in get_model_state_dict(sharded).items()}
    got["fsdp2_full_load"] = [loaded[k] for k in sorted(loaded)]
    got["fsdp2_matches_rank0"] = all(torch.equal(loaded[k], full_sd[k]) for k in full_sd)

    # DTensor: shard, then replicate
    x = torch.arange(4.0 * n * 3).reshape(4 * n, 3)
    dt = distribute_tensor(x, mesh, [Shard(0)])
    got["dtensor_local"] = dt.to_local().clone()
    got["dtensor_replicated"] = dt.redistribute(mesh, [Replicate()]).to_local().clone()

    # the functional collectives
    mine = torch.arange(4.0) + rank
    got["fc_all_reduce"] = fc.all_reduce(mine, "sum", group).wait()
    got["fc_all_gather"] = fc.all_gather_tensor(mine, 0, group).wait()
    got["fc_reduce_scatter"] = fc.reduce_scatter_tensor(
        torch.arange(2.0 * n) * (rank + 1), "sum", 0, group).wait()

    # tensors that are not contiguous, in every collective gloo runs on them: a channels_last
    # activation and a transposed matrix (results compared as laid out logically)
    layouts = {"channels_last": lambda v: (torch.arange(24.0) + v).reshape(2, 3, 2, 2).contiguous(
                   memory_format=torch.channels_last),
               "transposed": lambda v: (torch.arange(12.0) + v).reshape(4, 3).t()}
    for name, make in layouts.items():
        x = make(rank)
        dist.all_reduce(x)
        got[f"{name}_all_reduce"] = x.contiguous()
        x = make(rank)
        dist.broadcast(x, n - 1)
        got[f"{name}_broadcast"] = x.contiguous()
        x = make(rank)
        dist.reduce(x, 0)     # the root's result (gloo leaves partial sums on the others)
        got[f"{name}_reduce"] = x.contiguous() if rank == 0 else None
        outs = [make(-1) for _ in range(n)]
        dist.all_gather(outs, make(rank))
        got[f"{name}_all_gather"] = [o.contiguous() for o in outs]
        outs = [make(-1) for _ in range(n)] if rank == 0 else None
        dist.gather(make(rank), outs, 0)
        got[f"{name}_gather"] = [o.contiguous() for o in outs or []]
        x = make(-1)
        dist.scatter(x, [make(10 * j) for j in range(n)] if rank == 0 else None, 0)
        got[f"{name}_scatter"] = x.contiguous()
        x = make(-1)
        dist.reduce_scatter(x, [make(rank + 10 * j) for j in range(n)])
        got[f"{name}_reduce_scatter"] = x.contiguous()
        outs = [make(-1) for _ in range(n)]
        dist.all_to_all(outs, [make(rank + 10 * j) for j in range(n)])
        got[f"{name}_all_to_all"] = [o.contiguous() for o in outs]
        if backend == "anyccl":   # gloo refuses these ("input tensor has to be contiguous")
            x, right, left = make(-1), (rank + 1) % n, (rank - 1) % n
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, make(rank), right),
                                                   dist.P2POp(dist.irecv, x, left)]):
                request.wait()
            got["p2p_matches"] = got.get("p2p_matches", True) and torch.equal(
                x, make(left))

    # pipeline parallelism: one stage per rank, GPipe over 4 micro-batches (p2p between stages)
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(3)
    layers = [torch.nn.Linear(16, 16) for _ in range(n)]
    stage = PipelineStage(layers[rank], rank, n, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4,
                             loss_fn=lambda y, t: ((y - t) ** 2).mean())
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    losses: list = []
    if rank == 0:
        schedule.step(inputs)
    elif rank == n - 1:
        schedule.step(target=torch.zeros(8, 16), losses=losses)
    else:
        schedule.step()
    got["pipeline_grads"] = [p.grad.clone() for p in layers[rank].parameters()]
    got["pipeline_losses"] = [loss.detach().clone() for loss in losses]

    dist.barrier()
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    backend, world_size, port, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4]
    mp.spawn(run, args=(backend, world_size, port, out_dir), nprocs=world_size)
