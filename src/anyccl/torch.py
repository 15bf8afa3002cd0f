"""anyccl as a torch.distributed backend: ``init_process_group("anyccl")``.

Importing this module registers the backend "anyccl" with torch.distributed for CPU and CUDA
tensors (installing anyccl also registers it when torch is imported, through the
``torch.backends`` entry point; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off). Then
torch's own machinery runs on anyccl unchanged: DistributedDataParallel, the functional
collectives, object collectives, ``new_group(..., backend="anyccl")``::

    import torch.distributed as dist
    dist.init_process_group("anyccl")          # or "cpu:anyccl,cuda:anyccl"
    model = torch.nn.parallel.DistributedDataParallel(model)

Which anyccl transport serves the group follows anyccl's usual rules: shm (or mpi under
mpiexec) for CPU tensors, and for CUDA tensors the GPU backend ANYCCL_BACKEND names (nccl by
default; ipc, auto). Every rank of a group meets through the store torch hands the group.

Each operation runs as anyccl's blocking call and returns a torch Work whose future is already
complete: on CPU the result is in place when the call returns. On CUDA, as with NCCL's process
group, the operation is queued on the group's own stream for the device, after the work already
on the caller's current stream, with no host synchronisation: the caller's later kernels (the
rest of backward, under DDP) overlap it, and the future's CUDA event orders whoever waits on the
Work after the result (torch_streams.py; the group's compiled part, torch_core.py, does this
where it is built). CPU tensors are read through views built from their data pointers, never
``Tensor.numpy()`` (which would mark the caller's storage non-resizable for good).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import settings
from .algorithms.uneven import split_elements
from .bootstrap import C10dStore, connect
from .communicator import Communicator
from .errors import TimeoutError, UnsupportedError
from .ops import ReduceOp
from .torch_streams import GroupStreams

NAME = "anyccl"

_OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "PRODUCT": ReduceOp.PROD,
        "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX, "BAND": ReduceOp.BAND, "BOR": ReduceOp.BOR,
        "BXOR": ReduceOp.BXOR}
_RED_OP_TYPE = dist.ReduceOp.RedOpType
_BY_TYPE = {getattr(_RED_OP_TYPE, name): op for name, op in _OPS.items()}


def _reduce_op(opts: Any) -> ReduceOp:
    """anyccl's op for the c10d ReduceOp in `opts` (its `.op` enum has the name)."""
    raw = getattr(opts, "reduceOp", None)
    if raw is None:
        return ReduceOp.SUM
    kind = getattr(raw, "op", raw)
    found = _BY_TYPE.get(kind) if type(kind) is _RED_OP_TYPE else None
    if found is None:
        name = getattr(kind, "name", kind)
        raise UnsupportedError(f"the anyccl process group has no {name} reduction (torch's "
                               f"{name} is refused by name; use SUM, AVG, PRODUCT, MIN, MAX or "
                               f"a bitwise op)")
    return found


def _flat(tensors: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in tensors for t in inner]


class _Posted(dist.Work):
    """Messages on host tensors, posted and not yet waited for: a torch Work over anyccl's
    Works. torch posts every message of ``batch_isend_irecv`` before it waits for any (its
    fallback for process groups without NCCL-style coalescing), so a receive must not block
    when it is posted. Holds the tensors until done; names the sender of a receive from any
    rank (``dist.recv(tensor)`` without src returns ``work._source_rank()``)."""

    def __init__(self, works: list[Any], tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._works, self._tensors = works, tensors
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: Any = None) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        for work in self._works:
            work.wait(seconds if seconds else None)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        return self.is_completed() and all(w.exception() is None for w in self._works)

    def exception(self) -> Any:
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def _source_rank(self) -> int:
        self.wait()
        return self._works[-1].source if self._works else -1

    def get_future(self) -> torch.futures.Future:
        """A future of the tensors, complete once the messages are (it waits for them: host
        messages have no completion callback to set it later)."""
        if self._future is None:
            self.wait()
            self._future = torch.futures.Future()
            self._future.set_result(self._tensors)
        return self._future


class _BackendView:
    """What torch's own helpers get from ``group._get_backend(device)`` (``init_process_group(
    device_id=...)``, which Lightning passes on CUDA, `new_group`'s split, FSDP2's allocator):
    a backend that offers none of the C++ backends' extras."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return False


class ProcessGroup(dist.ProcessGroup):
    """A torch process group whose operations run on an anyccl Communicator."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._group_name = ""
        self._group_desc = ""
        self._streams = GroupStreams()   # where its CUDA operations run; its Works
        core = self._streams.core
        # all_reduce served from C++ (_torchcore.cpp's Allreduce), registered as the group's
        # backend per device: once the group has seen a CUDA all_reduce, torch reaches it
        # through its dispatcher, as it reaches NCCL's, and a replayed call skips this class
        self._compiled_allreduce = core is not None and type(self) is ProcessGroup
        if self._compiled_allreduce:
            core.install_allreduce(self, weakref.ref(self), self._streams.sides, comm._gpu_side,
                                   _REPLAY_TAGS)
        else:
            _declare_devices(self)

    def _run(self, call: Callable[[], object], result: Any, tensors: list[torch.Tensor]) -> Any:
        """Run `call` (anyccl's blocking calls on `tensors`) and return its torch Work, whose
        future holds `result`. With a CUDA tensor among them, the calls are queued on the
        group's own stream for the device after the work on the caller's current stream
        (torch_streams.py)."""
        index = -1
        for t in tensors:
            if t.is_cuda:
                index = t.get_device()
                break
        if index < 0:
            try:
                call()
            except TimeoutError as exc:
                raise self._in_torch_words(exc) from None
            return self._streams.done(result)
        return self._streams.run(index, call, tensors, result)   # (refuses another device)

    def _get_backend(self, device: Any) -> _BackendView:
        return _BackendView()

    # ---- identity: what DDP, FSDP2 and DeviceMesh ask ------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return NAME

    def name(self) -> str:
        return NAME

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    # ---- collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        if tensors and tensors[0].is_cuda:
            self._use_compiled_allreduce()
        op = _reduce_op(opts)

        def call() -> None:
            for t in tensors:
                if t.layout == torch.sparse_coo:
                    self._sparse_all_reduce(t, op)
                else:
                    self.comm.all_reduce(t, op)
        return self._run(call, tensors, tensors)

    _python_allreduce = allreduce   # what the compiled all_reduce leaves to this class

    def _use_compiled_allreduce(self) -> None:
        """From the next call on, every all_reduce goes to the compiled backend first, where it
        is installed. Done at the group's first CUDA all_reduce: host tensors come back to
        this class from there for about 2 us more, so a group that never holds CUDA tensors
        keeps calling it directly."""
        if self._compiled_allreduce:
            self.__class__ = _CompiledAllreduceGroup

    def _sparse_all_reduce(self, t: torch.Tensor, op: ReduceOp) -> None:
        """The sum of every rank's sparse COO tensor `t`, into `t` (as gloo: DDP's sparse
        gradients, nn.Embedding(sparse=True)). The ranks gather each other's entries
        (indices and values, each rank's own count), then every rank adds them up in rank
        order, so all hold the same coalesced result."""
        if op is not ReduceOp.SUM:
            raise UnsupportedError(f"rank {self.comm.rank}: all_reduce of a sparse tensor sums "
                                   f"only (as gloo's); {op.name} was asked")
        mine = t.coalesce()
        indices = mine.indices().t().contiguous()          # (nnz, sparse dims)
        values = mine.values().contiguous()                # (nnz, *dense shape)
        counts = torch.zeros(self.comm.size, dtype=torch.int64, device=t.device)
        self.comm.all_gather(counts, torch.tensor([indices.shape[0]], device=t.device))
        every_index = [torch.empty((int(n), indices.shape[1]), dtype=indices.dtype,
                                   device=t.device) for n in counts]
        every_value = [torch.empty((int(n), *values.shape[1:]), dtype=values.dtype,
                                   device=t.device) for n in counts]
        self.comm.all_gather(every_index, indices)
        self.comm.all_gather(every_value, values)
        total = torch.sparse_coo_tensor(torch.cat(every_index).t(), torch.cat(every_value),
                                        t.shape).coalesce()
        t.copy_(total)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._python_allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = getattr(opts, "rootRank", 0)

        def call() -> None:
            for t in tensors:
                self.comm.broadcast(t, root)
        return self._run(call, tensors, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op, root = _reduce_op(opts), getattr(opts, "rootRank", 0)

        def call() -> None:
            for t in tensors:
                self.comm.reduce(t, root, op)
        return self._run(call, tensors, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        def call() -> None:
            for outs, t in zip(output_tensors, input_tensors):
                self.comm.all_gather(outs, t)
        return self._run(call, output_tensors, _flat(output_tensors) + input_tensors)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> Any:
        """c10d passes coalesced outputs by rank, then tensor: output_lists[r][i] receives
        rank r's input_list[i] (the transpose of `allgather`'s layout)."""
        by_tensor = [[outs[i] for outs in output_lists] for i in range(len(input_list))]

        def call() -> None:
            for outs, t in zip(by_tensor, input_list):
                self.comm.all_gather(outs, t)
        return self._run(call, output_lists, _flat(output_lists) + input_list)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> Any:
        return self._run(lambda: self.comm.all_gather(output, input), output, [output, input])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        def call() -> None:
            for out, t in zip(outputs, inputs):
                self.comm.all_gather(out, t)
        return self._run(call, outputs, outputs + inputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        op = _reduce_op(opts)

        def call() -> None:
            for out, pieces in zip(output_tensors, input_tensors):
                self.comm.reduce_scatter(out, pieces, op)
        return self._run(call, output_tensors, output_tensors + _flat(input_tensors))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                              opts: Any = None) -> Any:
        op = _reduce_op(opts)
        return self._run(lambda: self.comm.reduce_scatter(output, input, op), output,
                         [output, input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        op = _reduce_op(opts)

        def call() -> None:
            for out, t in zip(outputs, inputs):
                self.comm.reduce_scatter(out, t, op)
        return self._run(call, outputs, outputs + inputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> Any:
        if not output_split_sizes and not input_split_sizes:
            return self._run(lambda: self.comm.all_to_all(output, input), output,
                             [output, input])
        # uneven: split sizes are rows along dim 0
        out_splits = split_elements(output.shape, output_split_sizes)
        in_splits = split_elements(input.shape, input_split_sizes)
        return self._run(lambda: self.comm.all_to_all(output, input, out_splits=out_splits,
                                                      in_splits=in_splits),
                         output, [output, input])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        return self._run(lambda: self.comm.all_to_all(output_tensors, input_tensors),
                         output_tensors, output_tensors + input_tensors)

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = getattr(opts, "rootRank", 0)
        outs = output_tensors[0] if self.comm.rank == root else None
        return self._run(lambda: self.comm.gather(input_tensors[0], outs, root), output_tensors,
                         _flat(output_tensors) + input_tensors)

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        root = getattr(opts, "rootRank", 0)
        chunks = input_tensors[0] if self.comm.rank == root else None
        return self._run(lambda: self.comm.scatter(output_tensors[0], chunks, root),
                         output_tensors, output_tensors + _flat(input_tensors))

    def barrier(self, opts: Any = None) -> Any:
        try:
            self.comm.barrier()
        except TimeoutError as exc:
            raise self._in_torch_words(exc) from None
        return self._streams.done(None)

    def _in_torch_words(self, exc: TimeoutError) -> TimeoutError:
        """anyccl's timeout, which names the rank, the op and what it waited for, with the
        phrase torch's tools and tests look for in a process group's timeout too."""
        return type(exc)(f"{exc}\n  (torch.distributed: Timed out after the process group's "
                         f"timeout of {self.comm.timeout_s:g} s)")

    # ---- messages ------------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        if not any(t.is_cuda for t in tensors):   # posted: torch waits on the Work
            return _Posted([self.comm.isend(t, dst, tag) for t in tensors], tensors)

        def call() -> None:
            for t in tensors:
                self.comm.send(t, dst, tag)
        return self._run(call, tensors, tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        if not any(t.is_cuda for t in tensors):
            return _Posted([self.comm.irecv(t, src, tag) for t in tensors], tensors)

        def call() -> None:
            for t in tensors:
                self.comm.recv(t, src, tag)
        return self._run(call, tensors, tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        """``dist.recv(t)`` / ``irecv(t)`` without src (host tensors): torch asks the Work
        for the sender."""
        return _Posted([self.comm.irecv(t, None, tag) for t in tensors], tensors)

    # ---- coalescing: operations run as they are issued, so a coalesced block is done at its end
    def _start_coalescing(self, device: torch.device) -> None:
        pass

    def _end_coalescing(self, device: torch.device) -> Any:
        return self._streams.done(None)

    def shutdown(self) -> None:
        self._close()

    # ---- failure as a state (the shape torchft's process groups have) -----------------------
    def errored(self) -> BaseException | None:
        """The error that broke this group (a lost rank, a timeout, an abort), else None: what
        a training loop checks after a failed step before it shrinks."""
        return self.comm.failure

    def abort(self) -> None:
        """End this group on this rank now, waiting for no peer and no queued GPU work
        (`Communicator.abort`)."""
        self.comm.abort()

    def shrink(self, timeout: float | timedelta | None = None) -> ProcessGroup:
        """After an error: every surviving rank calls this and gets a new group of the
        survivors, ranks renumbered in their old order (`Communicator.shrink`); this group is
        then closed. Pass the new group to what used this one (DDP's process_group=, FSDP's
        mesh, the data sampler's num_replicas/rank)."""
        new = self.comm.shrink(timeout)
        self.comm.close()
        return ProcessGroup(new)

    def grow(self, count: int | None = None,
             timeout: float | timedelta | None = None) -> ProcessGroup:
        """Every rank calls this to admit processes started later (`Communicator.grow`; a
        newcomer makes its group with `ProcessGroup(anyccl.join())`): a new group of this one's
        ranks, keeping their numbers, and the newcomers after them; this group is then closed
        (unless nobody was waiting and count is None: then it is returned itself). Pass the
        new group on as after `shrink`."""
        new = self.comm.grow(count, timeout)
        if new is self.comm:
            return self
        self.comm.close()
        return ProcessGroup(new)

    def _close(self) -> None:
        self.comm.close()   # (the GPU engine lets its streams go)


_DEVICES = ("cpu", "cuda")


class _CompiledAllreduceGroup(ProcessGroup):
    """The group where its compiled part is built, once it has run a CUDA all_reduce:
    ``allreduce`` is torch's own C++ method, which dispatches to the backend the group registered
    for the tensor's device (the compiled Allreduce of _torchcore.cpp), as torch's groups
    dispatch to NCCL or gloo. That backend runs a replayed CUDA all_reduce whole and hands every
    other one back to ``_python_allreduce``."""

    allreduce = vars(dist.ProcessGroup)["allreduce"]   # the method object, which binds `self`


# the communicator's replay tag of each torch reduction the group serves
_REPLAY_TAGS = {int(kind): ("all_reduce", op) for kind, op in _BY_TYPE.items()}


def _declare_devices(group: dist.ProcessGroup) -> None:
    """Make `group` declare the devices it serves, as a gloo or NCCL group does: torch reads
    them from the backends registered per device (``group._device_types``, the default device,
    DCP's async_save, FSDP2's broadcast_from_rank0 loading), and a Python group has none. Each
    device gets a placeholder that refuses every collective: every operation torch issues on
    this group reaches this group's own methods, and a path that reached the placeholder
    instead would fail loudly rather than skip the operation."""
    c10d = torch._C._distributed_c10d
    try:
        options = c10d.FakeProcessGroup.Options()
        options.error_on_collective = True
        make = c10d.FakeProcessGroup._create_internal
    except AttributeError:   # a torch whose placeholder cannot refuse: declare nothing
        return
    for device in _DEVICES:
        placeholder = make(group.rank(), group.size(), options)
        group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM,
                                placeholder)


def create(store: Any, rank: int, size: int, timeout: timedelta) -> ProcessGroup:
    """torch.distributed's creator of an "anyccl" process group: an anyccl communicator of the
    group's ranks, meeting through the store torch passes (`new_group` calls it again)."""
    comm = connect(C10dStore(store), rank, size, backend=None,
                   timeout_s=timeout.total_seconds(), local_rank=None, debug=settings.DEBUG.get())
    return ProcessGroup(comm)


def register() -> None:
    """Register the "anyccl" backend with torch.distributed (once; idempotent)."""
    if NAME.upper() in dist.Backend._plugins:  # type: ignore[attr-defined]
        return
    dist.Backend.register_backend(NAME, create, devices=list(_DEVICES))


register()
