"""Argument checks: every argument of a public operation is checked here, once, before any
byte moves, and a refusal names the rank, the operation, the argument and what was expected.
What passes is handed on as flat arrays (`Array`) that backends trust: a host array that is not
contiguous as a contiguous copy (layouts.py), which the caller settles once the call is done."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from .buffers import SUPPORTED, Array, NotContiguousGpuArray, Pieces, as_array, overlaps
from .errors import AnycclError, InvalidArgumentError
from .layouts import Staged, contiguous_copy, gpu_contiguous_copy
from .ops import ReduceOp, check_reduce_op

TAG_END = 2 ** 63   # tags are 0 .. 2**63 - 1
_VALID_OPS: dict[tuple[Any, np.dtype], ReduceOp] = {}  # (op as given, dtype) -> checked op


def seconds(timeout: float | timedelta | None, default: float) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise InvalidArgumentError(f"timeout={timeout!r} must be a positive number of seconds")
    return float(timeout)


class Arguments:
    """The checks for rank `rank` of a communicator of `size` ranks."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        # the arrays the call being checked writes through contiguous copies (layouts.py)
        self.staged: Staged = []

    def take_staged(self) -> Staged:
        """The staged arrays of the call just checked, for `layouts.settle` (or to drop, when
        the call was refused); the next call starts with none."""
        staged, self.staged = self.staged, []
        return staged

    def fail(self, op: str, message: str, kind: type = InvalidArgumentError) -> AnycclError:
        return kind(f"rank {self.rank}: {op}: {message}")

    def array(self, op: str, x: Any, name: str, *, writable: bool) -> Array:
        if type(x) is np.ndarray and x.dtype in SUPPORTED:
            flags = x.flags
            if flags.c_contiguous and (flags.writeable or not writable):
                return x if x.ndim == 1 else x.reshape(-1)  # the common case, at once
        try:
            try:
                arr = as_array(x, name, writable=writable)
            except NotContiguousGpuArray as exc:   # (its framework's array, found in x)
                arr = as_array(gpu_contiguous_copy(exc.array, name, writable, self.staged),
                               name, writable=writable)
            if type(arr) is np.ndarray and not arr.flags.c_contiguous:
                arr = contiguous_copy(arr, name, writable, self.staged)
        except AnycclError as exc:
            text, label = str(exc), _label(x)
            rest = text[len(name):] if text.startswith(f"{name} ") else ""
            if label and rest and not rest.startswith((" is a ", " of type ")):
                text = f"{name} ({label}){rest}"   # the argument, and what it is
            raise type(exc)(f"rank {self.rank}: {op}: {text}") from None
        except BaseException:
            self.staged.clear()   # an error from a library: no later call writes these back
            raise
        return arr.reshape(-1)

    def message(self, op: str, x: Any, peer: Any, peer_name: str, tag: Any,
                writable: bool) -> tuple[Array, int | None, int]:
        """A send's or receive's array, peer and tag. peer=None is a receive from any rank
        (peer_name "src"); a rank never messages itself."""
        if peer is None and peer_name == "src":
            return self.array(op, x, "tensor", writable=True), None, self.tag(op, tag)
        peer = self.peer(op, peer, peer_name)
        if peer == self.rank:
            raise self.fail(op, f"{peer_name}={peer} is this rank; a rank cannot message itself")
        return self.array(op, x, "tensor", writable=writable), peer, self.tag(op, tag)

    def exchange(self, x: Any, dst: Any, y: Any, src: Any,
                 tag: Any) -> tuple[Array, int, Array, int | None, int]:
        """sendrecv's arrays, peers and tag: `message`'s checks of the send (`x` to `dst`) and
        of the receive (into `y` from `src`), and the two arrays apart in memory."""
        size, rank = self.size, self.rank
        if type(x) is np.ndarray and type(y) is np.ndarray and type(dst) is int \
                and type(src) is int and type(tag) is int and 0 <= dst < size and dst != rank \
                and 0 <= src < size and src != rank and 0 <= tag < TAG_END \
                and x.base is None and y.base is None and x is not y \
                and x.dtype in SUPPORTED and y.dtype in SUPPORTED:
            fx, fy = x.flags, y.flags
            if fx.c_contiguous and fy.c_contiguous and fy.writeable:   # the common case
                return (x if x.ndim == 1 else x.reshape(-1)), dst, \
                    (y if y.ndim == 1 else y.reshape(-1)), src, tag
        x, dst, tag = self.message("sendrecv", x, dst, "dst", tag, False)
        y, src, _ = self.message("sendrecv", y, src, "src", tag, True)
        self.disjoint("sendrecv", x, "send_tensor", y, "recv_tensor")
        return x, dst, y, src, tag  # type: ignore[return-value]

    def peer(self, op: str, value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self.fail(op, f"{name}={value!r} must be an int rank")
        if not 0 <= value < self.size:
            raise self.fail(op, f"{name}={value} is out of range; this communicator has "
                                f"{self.size} rank{'s' if self.size > 1 else ''} "
                                f"(0..{self.size - 1})")
        return int(value)

    def reduced(self, op_name: str, x: Any, op: Any) -> tuple[Array, ReduceOp]:
        """The array a reducing collective writes in place, flat, and its checked reduce op
        (`array` and `reduce_op` in one call: what every call of a training loop passes is
        answered at once)."""
        if type(x) is np.ndarray:
            reduce_op = _VALID_OPS.get((op, x.dtype))   # only ever holds supported dtypes
            if reduce_op is not None:
                flags = x.flags
                if flags.c_contiguous and flags.writeable:
                    return (x if x.ndim == 1 else x.reshape(-1)), reduce_op
        x = self.array(op_name, x, "tensor", writable=True)
        return x, self.reduce_op(op_name, op, x.dtype)

    def reduce_op(self, op_name: str, op: Any, dtype: np.dtype) -> ReduceOp:
        try:
            return _VALID_OPS[(op, dtype)]  # every call of a training loop asks the same
        except (KeyError, TypeError):
            pass
        try:
            reduce_op = ReduceOp.parse(op)
            check_reduce_op(reduce_op, dtype)
        except AnycclError as exc:
            raise type(exc)(f"rank {self.rank}: {op_name}: {exc}") from None
        if len(_VALID_OPS) < 1024:
            try:
                _VALID_OPS[(op, dtype)] = reduce_op
            except TypeError:  # an unhashable op spelling: just not cached
                pass
        return reduce_op

    def pieces(self, op: str, arg: Any, name: str, like: Array, *,
               writable: bool, sizes_may_differ: bool = False) -> list[Array]:
        """`arg` as `size` flat arrays shaped like `like`: a list of them, or one array of
        size * like.size elements split evenly. `sizes_may_differ`: a list's arrays need only
        share `like`'s dtype (the uneven collectives)."""
        if isinstance(arg, (list, tuple)):
            if len(arg) != self.size:
                raise self.fail(op, f"{name} has {len(arg)} entries; expected one per rank "
                                    f"({self.size})")
            pieces = [self.array(op, a, f"{name}[{i}]", writable=writable)
                      for i, a in enumerate(arg)]
        else:
            whole = self.array(op, arg, name, writable=writable)
            if whole.size != self.size * like.size:
                raise self.fail(op, f"{name} has {whole.size} elements; expected {self.size} x "
                                    f"{like.size} = {self.size * like.size} (one piece per rank)")
            if whole.dtype != like.dtype:  # every piece alike: one dtype check for all
                self.same(op, whole, like, name)
            return Pieces(whole, like.size, self.size)
        for i, piece in enumerate(pieces):
            self.same(op, piece, like, f"{name}[{i}]", sizes_may_differ)
        return pieces

    def root_pieces(self, op: str, arg: Any, name: str, like: Array, root: int,
                    root_name: str, *, writable: bool,
                    sizes_may_differ: bool = False) -> list[Array] | None:
        """The root's list argument of gather/scatter as pieces; None, as required, elsewhere."""
        if self.rank != root:
            if arg is not None:
                raise self.fail(op, f"{name} must be None on ranks other than "
                                    f"{root_name}={root}")
            return None
        if arg is None:
            raise self.fail(op, f"{name} is None on the {root_name} rank {root}; pass "
                                f"{self.size} arrays like {'tensor' if op == 'gather' else 'out'}")
        return self.pieces(op, arg, name, like, writable=writable,
                           sizes_may_differ=sizes_may_differ)

    def same(self, op: str, x: Array, like: Array, name: str,
             sizes_may_differ: bool = False) -> None:
        if x.dtype != like.dtype:
            raise self.fail(op, f"{name} has dtype {x.dtype.name}; expected {like.dtype.name} "
                                f"like the other arrays of this call")
        if x.size != like.size and not sizes_may_differ:
            raise self.fail(op, f"{name} has {x.size} elements; expected {like.size}")

    def others_disjoint(self, op: str, pieces: list[Array], name: str, x: Array,
                        x_name: str) -> None:
        """Only this rank's own piece may share memory with `x` (the in-place form)."""
        if isinstance(pieces, Pieces) and not overlaps(pieces.whole, x):
            return  # one check for the common case: pieces of one array apart from x
        for i, piece in enumerate(pieces):
            if i != self.rank:
                self.disjoint(op, piece, f"{name}[{i}]", x, x_name)

    def rooted(self, op: str, array: Any, name: str, root: Any, root_name: str, pieces: Any,
               pieces_name: str, uneven: bool) -> tuple[Array, int, list[Array] | None]:
        """gather's (op "gather": the root's pieces receive) or scatter's arguments: (array,
        root, the root's pieces; None elsewhere and for the uneven forms, whose pieces are
        checked once their sizes are known)."""
        gathers = op == "gather"
        x = self.array(op, array, name, writable=not gathers)
        root = self.peer(op, root, root_name)
        checked = None
        if not uneven:
            checked = self.root_pieces(op, pieces, pieces_name, x, root, root_name,
                                       writable=gathers)
            if not gathers:
                self.others_disjoint(op, checked or [], pieces_name, x, name)
        return x, root, checked

    def all_gather(self, out: Any, tensor: Any) -> tuple[Array, list[Array], bool]:
        """all_gather's arguments: (tensor, out as `size` pieces, whether they are even). The
        pieces may differ in size (allgatherv); even ones may not overlap `tensor`, except
        this rank's own piece (in place)."""
        x = self.array("all_gather", tensor, "tensor", writable=False)
        outs = self.pieces("all_gather", out, "out", x, writable=True,
                           sizes_may_differ=self.size > 1)
        even = type(outs) is Pieces or all(o.size == x.size for o in outs)   # (by construction)
        if even:
            self.others_disjoint("all_gather", outs, "out", x, "tensor")
        return x, outs, even

    def reduce_scatter(self, out: Any, inp: Any, op: Any) -> tuple[Array, list[Array], ReduceOp]:
        """reduce_scatter's arguments: (out, inp as `size` pieces like out, the reduce op)."""
        x = self.array("reduce_scatter", out, "out", writable=True)
        inputs = self.pieces("reduce_scatter", inp, "inp", x, writable=False)
        self.others_disjoint("reduce_scatter", inputs, "inp", x, "out")
        return x, inputs, self.reduce_op("reduce_scatter", op, x.dtype)

    def all_to_all(self, out: Any, inp: Any) -> tuple[list[Array], list[Array], Array]:
        """all_to_all's lists (or single arrays split evenly): (outs, inputs, inputs' first
        piece), no out[i] overlapping an inp[j] of another rank's piece."""
        op = "all_to_all"
        if isinstance(inp, (list, tuple)):
            if not inp:
                raise self.fail(op, "inp is an empty list")
            first = self.array(op, inp[0], "inp[0]", writable=False)
        else:
            whole = self.array(op, inp, "inp", writable=False)
            if whole.size % self.size:
                raise self.fail(op, f"inp has {whole.size} elements, not divisible into "
                                    f"{self.size} equal pieces")
            first = whole[: whole.size // self.size]
        inputs = self.pieces(op, inp, "inp", first, writable=False)
        outs = self.pieces(op, out, "out", first, writable=True)
        for i, o in enumerate(outs):
            for j, piece in enumerate(inputs):
                if i != j:
                    self.disjoint(op, o, f"out[{i}]", piece, f"inp[{j}]")
        return outs, inputs, first

    def all_to_all_uneven(self, out: Any, inp: Any, out_splits: Any, in_splits: Any
                          ) -> tuple[Array, Array, list[int], list[int]]:
        """all_to_all with split sizes: (inp, out, elements sent to each rank, received from
        each), one dtype, separate arrays, the splits adding up to the arrays' sizes."""
        from .algorithms import uneven

        op, n = "all_to_all", self.size
        x = self.array(op, inp, "inp", writable=False)
        y = self.array(op, out, "out", writable=True)
        if x.dtype != y.dtype:
            raise self.fail(op, f"out has dtype {y.dtype.name} but inp has {x.dtype.name}")
        if overlaps(x, y):
            raise self.fail(op, "out and inp share memory; with split sizes pass separate "
                                "arrays")
        sends = uneven.check_splits(self.rank, n, [x.size // n] * n if in_splits is None else
                                    in_splits, "in_splits", x.size, "inp")
        receives = uneven.check_splits(self.rank, n, [y.size // n] * n if out_splits is None
                                       else out_splits, "out_splits", y.size, "out")
        return x, y, sends, receives

    def disjoint(self, op: str, a: Array, a_name: str, b: Array, b_name: str) -> None:
        if overlaps(a, b):
            raise self.fail(op, f"{a_name} and {b_name} overlap in memory; the result would "
                                f"corrupt the input")

    def tag(self, op: str, tag: Any) -> int:
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not \
                0 <= tag < TAG_END:
            raise self.fail(op, f"tag={tag!r} must be an int from 0 to 2**63-1")
        return int(tag)


def _label(x: Any) -> str:
    """What kind of array `x` is, for a refusal that names its argument ("a NumPy array"); empty
    where the message says it already (None, Python numbers and sequences)."""
    if x is None or isinstance(x, (bool, int, float, complex, list, tuple)):
        return ""
    if isinstance(x, np.ndarray):
        return "a NumPy array"
    module = type(x).__module__.split(".")[0]
    framework = {"torch": "torch", "cupy": "CuPy", "jax": "JAX", "jaxlib": "JAX"}.get(module)
    if framework is not None:
        return f"a {framework} {'tensor' if framework == 'torch' else 'array'}"
    return f"a {type(x).__name__}"


def named(name: str, pieces: Sequence[Array]) -> list[tuple[str, Array]]:
    """The arrays a call reads or writes, named for messages: one array split into pieces is
    itself (its pieces share its device and stream), else each piece."""
    if isinstance(pieces, Pieces):
        return [(name, pieces.whole)]
    return [(f"{name}[{i}]", p) for i, p in enumerate(pieces)]

