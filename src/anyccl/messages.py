"""Point-to-point messages as a Communicator serves them: each message numbered per (kind,
peers) for its record, then routed by device: host arrays to the host engine (a blocking
exchange runs on the caller's thread when it may drive the backend), GPU arrays to the GPU
engine, queued on streams (inside `comm.batch()`, collected into one group)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .arguments import TAG_END, Arguments
from .buffers import SUPPORTED, Array
from .engine import HostEngine
from .gpu_dispatch import GpuDispatch
from .layouts import check_stream, settle
from .trace import OpRecord, message_text
from .work import Work

if TYPE_CHECKING:
    from .communicator import Communicator


_OPS = {("send", False): "send", ("send", True): "isend", ("recv", False): "recv",
        ("recv", True): "irecv"}
_PEER_NAMES = {"send": "dst", "recv": "src"}


class MessageCalls:
    """The point-to-point side of one communicator (its arguments checked already)."""

    def __init__(self, comm: Communicator, check: Arguments, engine: HostEngine,
                 gpu_side: GpuDispatch) -> None:
        self._comm, self._check, self._engine, self._gpu_side = comm, check, engine, gpu_side
        self._rank, self._size = check.rank, check.size
        self._log = comm.flight_recorder.add
        self._seq: defaultdict[tuple[str, int | None, int | None], Iterator[int]] = \
            defaultdict(lambda: itertools.count(1))
        # the backend's compiled whole-call sendrecv, if it has one (Backend.exchange_context)
        self._exchange, self._exchange_context = engine.backend.exchange_context(
            engine, self._log, self._seq) or (None, None)

    def record(self, kind: str, x: Array, peer: int | None, tag: int,
               src: int | None = None) -> OpRecord:
        """The record of a message (kind "sendrecv": of an exchange, receiving from `src`),
        numbered per kind and peers (the host engine's and the GPU engine's callers put it
        in the flight recorder)."""
        seq = next(self._seq[kind, peer, src])
        nbytes = x.nbytes
        return OpRecord(kind, seq, (message_text, kind, peer, tag, nbytes, src), nbytes)

    def message(self, kind: str, tensor: Any, peer: Any, tag: Any, async_op: bool,
                stream: Any = None) -> Work | int | None:
        """`comm.send`, `recv`, `isend`, `irecv` (kind "send" or "recv"): checked, numbered,
        then routed (peer=None: receive from any rank); a blocking receive returns the sender,
        an async call its Work. The common case goes straight to the host engine: a
        C-contiguous NumPy array of a supported dtype (writable, to receive into), another rank
        of this communicator as an int and an int tag in range need no other check."""
        if type(tensor) is np.ndarray and type(peer) is int and type(tag) is int \
                and stream is None and 0 <= peer < self._size and peer != self._rank \
                and 0 <= tag < TAG_END and tensor.dtype in SUPPORTED and not self._comm._closed:
            flags = tensor.flags
            if flags.c_contiguous and (flags.writeable or kind == "send") \
                    and (async_op or self._gpu_side.batched is None):
                x = tensor if tensor.ndim == 1 else tensor.reshape(-1)
                nbytes = x.nbytes   # `record`, inline
                record = OpRecord(kind, next(self._seq[kind, peer, None]),
                                  (message_text, kind, peer, tag, nbytes, None), nbytes)
                self._log(record)
                if async_op:
                    return self._engine.message(kind, x, peer, tag, record)
                return self._engine.blocking(kind, x, peer, tag, record)
        op = _OPS[kind, async_op]
        if self._comm._closed:
            self._comm._check_open(op)
        try:
            x, peer, tag = self._check.message(op, tensor, peer, _PEER_NAMES[kind], tag,
                                               kind == "recv")
        finally:   # a receive into a non-contiguous array: its copy, written back when done
            staged = self._check.take_staged()
        gpu_side = self._gpu_side
        if (stream is not None or type(x) is not np.ndarray) and gpu_side.on_gpu(
                op, [("tensor", x)], stream):
            if peer is None:
                raise self._check.fail(op, "src=None (from any rank) needs host arrays: GPU "
                                           "messages match in issue order between two named "
                                           "ranks (NCCL has no any-source receive); name src")
            check_stream(staged, stream, lambda text: self._check.fail(op, text))
            return settle(gpu_side.message(op, self.record(kind, x, peer, tag), x, peer, tag,
                                           async_op, stream), staged)
        if gpu_side.batched is not None and not async_op:
            raise self._check.fail(kind, f"use i{kind} inside `with comm.batch():`")
        record = self.record(kind, x, peer, tag)
        self._log(record)
        engine = self._engine
        return settle((engine.message if async_op else engine.blocking)(kind, x, peer, tag,
                                                                         record), staged)

    def sendrecv(self, send_tensor: Any, dst: int, recv_tensor: Any, src: int | None,
                 tag: int, stream: Any) -> int | None:
        """`comm.sendrecv`: both messages checked, then exchanged at once (host arrays: as one
        blocking operation; GPU arrays: as one batch); returns the sender."""
        if (ctx := self._exchange_context) is not None and stream is None and \
                (done := self._exchange(ctx, self._comm, send_tensor, dst, recv_tensor, src,
                                        tag)) is not None:
            return done   # the whole call compiled (host arrays: `exchange_context`)
        try:
            x, dst, y, src, tag = self._check.exchange(send_tensor, dst, recv_tensor, src, tag)
        finally:
            staged = self._check.take_staged()
        if self._gpu_side.batched is not None:
            raise self._check.fail("sendrecv",
                                   "use isend and irecv inside `with comm.batch():`")
        if stream is None and type(x) is np.ndarray and type(y) is np.ndarray:
            record = self.record("sendrecv", x, dst, tag, src)
            self._log(record)
            return settle(self._engine.sendrecv(record, x, dst, y, src, tag), staged)
        comm = self._comm
        with comm.batch():   # GPU arrays: one group; isend and irecv take the caller's arrays
            sent = comm.isend(send_tensor, dst, tag, stream=stream)
            received = comm.irecv(recv_tensor, src, tag, stream=stream)
        sent.wait()
        received.wait()
        return src if src is not None else received.source
