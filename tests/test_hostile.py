"""Random programs of valid and invalid calls across ranks (hypothesis), and a short soak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from harness import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import assert_matches, make_input, reduce_reference, valid_ops
from test_bad_input import BAD_CALLS, LOCAL_ONLY

import anyccl

WORLD = 3
# invalid on every rank that makes them (some table entries are only invalid on one rank)
HOSTILE = sorted(set(BAD_CALLS) - {"send_to_self", "scatter_without_chunks_on_src",
                                   "gather_list_on_non_root"})
DTYPES = [np.dtype(d) for d in (np.bool_, np.int8, np.uint16, np.int64, np.float16,
                                np.float32, np.float64, np.complex64)]
COLLECTIVE_NAMES = ["all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter",
                    "reduce_scatter", "all_to_all"]


@st.composite
def steps(draw):
    if draw(st.integers(0, 3)) == 0:
        return ("invalid", draw(st.integers(0, WORLD - 1)), draw(st.sampled_from(HOSTILE)))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(valid_ops(dtype)))
    return ("valid", draw(st.sampled_from(COLLECTIVE_NAMES)), dtype.str,
            draw(st.sampled_from([0, 1, 7, 100, 5000])), draw(st.integers(0, WORLD - 1)),
            op.name)


def run_program(comm, program):
    n, me = comm.size, comm.rank
    for i, step in enumerate(program):
        if step[0] == "invalid":
            _, rank, name = step
            if me == rank:
                try:
                    BAD_CALLS[name][0](comm)
                except anyccl.AnycclError:
                    pass
                else:
                    raise AssertionError(f"step {i}: {name} was accepted")
            elif name not in LOCAL_ONLY:  # the refusal is told: the others' call raises too
                try:
                    comm.barrier()
                except anyccl.CollectiveMismatchError as exc:
                    assert f"rank {rank} refused its arguments" in str(exc), str(exc)
                else:
                    raise AssertionError(f"step {i}: rank {rank}'s refusal was not told")
            continue
        _, name, dtype_str, count, root, op_name = step
        dtype, op = np.dtype(dtype_str), anyccl.ReduceOp[op_name]
        mine = make_input(me, count, dtype, salt=i)
        every = [make_input(r, count, dtype, salt=i) for r in range(n)]
        what = f"step {i}: {name} {dtype} x {count} root {root} {op_name}"
        if name in ("all_reduce", "reduce"):
            x = mine.copy()
            comm.all_reduce(x, op) if name == "all_reduce" else comm.reduce(x, root, op)
            if name == "all_reduce" or me == root:
                assert_matches(x, reduce_reference(every, op), what)
        elif name == "broadcast":
            comm.broadcast(mine, root)
            assert_matches(mine, every[root], what)
        elif name in ("all_gather", "gather"):
            outs = [np.empty(count, dtype) for _ in range(n)]
            if name == "all_gather":
                comm.all_gather(outs, mine)
            else:
                comm.gather(mine, outs if me == root else None, root)
            if name == "all_gather" or me == root:
                for r in range(n):
                    assert_matches(outs[r], every[r], what)
        elif name == "scatter":
            out = np.empty(count, dtype)
            comm.scatter(out, every if me == root else None, root)
            assert_matches(out, every[me], what)
        elif name == "reduce_scatter":
            pieces = [make_input(me, count, dtype, salt=i + j) for j in range(n)]
            out = np.empty(count, dtype)
            comm.reduce_scatter(out, pieces, op)
            assert_matches(out, reduce_reference(
                [make_input(r, count, dtype, salt=i + me) for r in range(n)], op), what)
        else:
            pieces = [make_input(me, count, dtype, salt=i + j) for j in range(n)]
            outs = [np.empty(count, dtype) for _ in range(n)]
            comm.all_to_all(outs, pieces)
            for j in range(n):
                assert_matches(outs[j], make_input(j, count, dtype, salt=i + me), what)
    x = np.ones(3)
    comm.all_reduce(x)
    return bool((x == n).all())


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(steps(), min_size=1, max_size=10))
def test_random_programs_of_valid_and_invalid_calls(program):
    assert all(run_ranks(run_program, WORLD, program))


def test_short_soak_keeps_memory_and_descriptors_flat(tmp_path):
    report_path = tmp_path / "soak.json"
    soak = Path(__file__).parent.parent / "benchmarks" / "soak.py"
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "4", str(soak),
                           "--ops", "400", "--max-bytes", "1M", "--json", str(report_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["ops"] == 400 and sum(report["op_counts"].values()) == 400
    for rank, samples in report["per_rank"].items():
        assert samples[-1]["open_fds"] == samples[0]["open_fds"], f"rank {rank} leaks fds"
        growth = samples[-1]["rss_mb"] - samples[0]["rss_mb"]
        assert growth < 16, f"rank {rank}'s resident memory grew {growth:.1f} MB in 360 ops"
