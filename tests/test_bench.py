"""`anyccl bench`: nccl-tests columns and conventions, real result checks, comparisons."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from anyccl import ReduceOp
from anyccl.tools import bench


def _bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "anyccl", "bench", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_every_op_runs_with_no_wrong_element_in_nccl_tests_format(tmp_path):
    out = tmp_path / "rows.json"
    proc = _bench("-n", "3", "--op", "all", "--min", "8", "--max", "1M", "--factor", "16",
                  "--iters", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = "#       size         count      type   redop    root     time   algbw   busbw #wrong"
    assert proc.stdout.count(header) == len(bench.OPS)
    assert proc.stdout.count("# Out of bounds values : 0 OK") == len(bench.OPS)
    assert "# Avg bus bandwidth    :" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    measured = [r for r in rows if r["time_us"] is not None]
    assert {r["op"] for r in measured} == set(bench.OPS)
    assert [r for r in measured if r["wrong"] != 0 or not r["busbw"] > 0] == []
    line = next(ln for ln in proc.stdout.splitlines() if ln.split()[:1] == ["32768"])
    assert line.split()[1:5] == ["8192", "float", "sum", "-1"]  # all_reduce comes first
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("redop", ["sum", "prod"])
def test_thousands_of_in_place_reductions_print_no_warning_and_stay_checked(redop):
    # automatic iteration counts repeat in-place sums and products thousands of times
    proc = _bench("-n", "2", "--op", "all_reduce,reduce_scatter", "--min", "2K", "--max", "4K",
                  "--redop", redop, "--rounds", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]
    assert proc.stdout.count("# Out of bounds values : 0 OK") == 2


@pytest.mark.parametrize("op", bench.OPS)
def test_the_result_check_counts_corrupted_elements(op):
    count, n = 64, 3
    for rank in range(n):
        buffers, wrong = bench.build(op, count, np.dtype(np.float32), rank, n, 0, False,
                                     ReduceOp.SUM)
        if op in ("reduce", "gather") and rank != 0:
            assert wrong(buffers) == 0  # nothing is defined there to check
            continue
        target = next(k for k in ("buf", "out", "out_whole") if buffers.get(k) is not None)
        buffers[target].reshape(-1)[:5] = 1e9  # a broken collective wrote garbage
        assert wrong(buffers) >= 5, (op, rank)


def test_sizes_and_bus_factors_follow_nccl_tests():
    assert bench.sizes_of("all_reduce", 1024, 4, 4) == (256, 1024)
    assert bench.sizes_of("all_gather", 1024, 4, 4) == (64, 1024)
    assert bench.sizes_of("reduce_scatter", 1000, 4, 3) == (83, 996)
    assert bench.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bench.bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bench.bus_factor("broadcast", 4) == bench.bus_factor("sendrecv", 4) == 1.0


@pytest.mark.parametrize("probe_s, expected", [(2e-6, bench._MAX_ITERS), (1e-3, 100),
                                                (10.0, 5)])
def test_automatic_iterations_fill_the_time_per_size_up_to_a_bound(monkeypatch, probe_s,
                                                                   expected):
    """Rounds of a microsecond call are long enough that a core taken away for a few
    milliseconds moves one round by a few percent, not by half: the probe's time sets the
    calls per round so that all rounds take about _TARGET_S, between 5 and _MAX_ITERS."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    class One:   # the slowest rank's probe is this rank's
        def all_reduce(self, x, op):
            assert op == ReduceOp.MAX

    class Here:
        def sync(self):
            pass

    def run():
        clock[0] += probe_s

    assert abs(bench._agreed_iters(One(), run, Here(), rounds=3) - expected) <= 1


def test_compare_with_torch_prints_ratios_and_plots(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    proc = _bench("-n", "2", "--op", "all_reduce,broadcast", "--min", "1K", "--max", "64K",
                  "--factor", "8", "--iters", "3", "--compare", "torch", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "# all_reduce: busbw (GB/s, in-place); ratio = anyccl (shm) / peer" in proc.stdout
    assert "# Out of bounds values : 0 OK (torch)" in proc.stdout
    lines = [ln.split() for ln in proc.stdout.splitlines() if ln.split()[:1] == ["1024"]]
    table = [ln[-1] for ln in lines if len(ln) == 15]   # nccl-tests' 13, spread, library
    assert table == ["anyccl", "torch"] * 2   # each line says whose it is
    assert png.stat().st_size > 10_000


def test_bad_options_are_refused_clearly():
    proc = _bench("--op", "all_sum")
    assert proc.returncode != 0 and "--op all_sum: expected one of" in proc.stderr
    proc = _bench("--max", "lots")
    assert proc.returncode != 0 and "--max='lots' is not a size" in proc.stderr
    proc = _bench("--compare", "glue")
    assert proc.returncode != 0 and "--compare glue: expected some of torch, gloo, symm, mpi, " \
        "shm, shm+gloo, shm+mpi, nccl, ipc, auto" in proc.stderr
    proc = _bench("--compare", "symm")
    assert proc.returncode != 0 and "--compare symm measures GPU arrays: add --device cuda" \
        in proc.stderr
    proc = _bench("--rounds", "0")
    assert proc.returncode != 0 and "--rounds 0: expected at least 1" in proc.stderr


@pytest.mark.parametrize("args, said", [
    (["--max", "1X"], "anyccl bench: --max='1X' is not a size"),
    (["--compare", "nccl"], "anyccl bench: --compare nccl measures GPU arrays: add --device cuda"),
    (["--backend", "bogus"], "anyccl bench: --backend bogus: backend='bogus' is unknown"),
    ([], "anyccl bench: -n N: how many ranks to start"),
    (["-n", "0"], "anyccl bench: -n 0: need at least one rank"),
])
def test_arguments_are_checked_once_before_any_rank_starts(args, said):
    proc = _bench(*[*(["-n", "2"] if args and args[0] != "-n" else []), *args], timeout=60)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count(said) == 1
    assert proc.stdout == ""


def test_a_peer_whose_library_is_missing_is_refused_before_any_rank_starts(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "torch" else real(name, *a))
    for peer in ("torch", "gloo"):
        assert bench.main(["-n", "2", "--compare", peer]) == 2
        err = capsys.readouterr().err
        assert f"--compare {peer} needs torch, which is not installed" in err, err
        assert "Traceback" not in err and err.count("needs torch") == 1


def test_compare_gloo_names_torchs_gloo_on_host_arrays():
    pytest.importorskip("torch")
    proc = _bench("-n", "2", "--op", "all_reduce", "--min", "1K", "--max", "1K", "--iters", "2",
                  "--rounds", "1", "--compare", "gloo", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.split()[:1] == ["1024"]]
    assert [r[-1] for r in rows if len(r) == 15] == ["anyccl", "gloo"]
    assert "# Out of bounds values : 0 OK (gloo)" in proc.stdout
    proc = _bench("-n", "2", "--device", "cuda", "--compare", "gloo", timeout=60)
    assert proc.returncode == 2 and ("--compare gloo measures host arrays" in proc.stderr
                                     or "no CUDA GPU is visible" in proc.stderr)


def test_without_a_gpu_gpu_measurements_are_refused_before_starting():
    from anyccl import gpu

    if gpu.device_count():
        pytest.skip("this machine has a GPU")
    proc = _bench("-n", "2", "--device", "cuda", "--compare", "nccl", timeout=60)
    assert proc.returncode == 2 and "--device cuda: no CUDA GPU is visible here" in proc.stderr
    proc = _bench("-n", "2", "--backend", "nccl", timeout=60)
    assert proc.returncode == 2 and "--backend nccl: nccl runs on CUDA GPUs, and none is " \
        "visible here" in proc.stderr


def test_comparing_with_mpi_keeps_anyccl_on_its_default_backend():
    """--compare mpi starts the job with mpiexec; anyccl itself still runs shm (the default on
    one machine) and the table says so, instead of comparing MPICH with MPICH."""
    pytest.importorskip("mpi4py")
    import shutil

    if shutil.which("mpiexec") is None:
        pytest.skip("needs mpiexec")
    proc = _bench("-n", "2", "--op", "all_reduce", "--min", "1K", "--max", "1K", "--iters", "3",
                  "--rounds", "1", "--compare", "mpi", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend shm (cpu)" in proc.stdout
    assert "ratio = anyccl (shm) / peer" in proc.stdout


def test_rows_stream_as_they_are_measured_with_the_spread_of_their_rounds():
    """The first size's line arrives before the last size is measured; every line ends with
    the spread of its rounds in percent."""
    import time

    proc = subprocess.Popen([sys.executable, "-m", "anyccl", "bench", "-n", "2", "--op",
                             "all_reduce", "--min", "1K", "--max", "32M", "--factor", "32",
                             "--rounds", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first_at = last_at = None
    start = time.monotonic()
    lines = []
    for line in proc.stdout:
        if line.split()[:1] == ["1024"]:
            first_at = time.monotonic() - start
        if line.split()[:1] == [str(32 << 20)]:
            last_at = time.monotonic() - start
        lines.append(line)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert first_at is not None and last_at is not None and first_at < last_at
    assert "spread" in "".join(lines)
    rows = [ln.split() for ln in lines if ln[:1] == " " and ln.split()[0].isdigit()]
    assert len(rows) == 4 and all(r[-1].isdigit() for r in rows)


class _Recording:
    """A library that only notes when it runs (a one-rank all_reduce leaves its input as is)."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def barrier(self) -> None:
        pass

    def runner(self, op, b, redop, root):
        return lambda: self.calls.append(self.name)


def test_libraries_take_turns_in_rotating_rounds_then_each_result_is_checked():
    import anyccl

    comm, calls = anyccl.init("shm"), []
    settings = bench.Settings(["all_reduce"], 64, 64, 2, np.dtype(np.float32), ReduceOp.SUM, 0,
                              iters=2, warmup=0, rounds=3)
    rows = bench.measure(comm, [_Recording("a", calls), _Recording("b", calls)], "all_reduce",
                         64, settings, in_place=True)
    comm.close()
    assert "".join(calls) == "aabb" + "bbaa" + "aabb" + "ab"  # the order turns each round
    assert [(r.library, r.wrong) for r in rows] == [("a", 0), ("b", 0)]
    assert all(r.time_us > 0 and r.busbw is not None for r in rows)


@pytest.mark.parametrize("dtype, redop", [
    (np.float32, ReduceOp.SUM), (np.float16, ReduceOp.AVG), (np.int32, ReduceOp.PROD),
    (np.uint8, ReduceOp.BXOR), (np.bool_, ReduceOp.SUM), (np.bool_, ReduceOp.MIN),
    (np.complex64, ReduceOp.SUM), (np.int64, ReduceOp.MIN),
])
def test_the_check_judges_anyccl_s_kernels_against_numpy_not_against_themselves(
        dtype, redop, monkeypatch):
    """#wrong's expected values come from NumPy alone: a bug in anyccl's own reduction kernels
    (here: every reduction made to give the first rank's values) is counted, not copied."""
    from anyccl import ops

    n, count = 3, 64
    inputs = [bench.build("all_reduce", count, np.dtype(dtype), r, n, 0, True, redop)[0]["buf"]
              for r in range(n)]
    buffers, wrong = bench.build("all_reduce", count, np.dtype(dtype), 0, n, 0, True, redop)
    right = inputs[0].copy()
    for other in inputs[1:]:        # what a correct all_reduce gives, with anyccl's kernels
        ops.accumulate(right, other, redop)
    ops.finish(right, redop, n)
    buffers["buf"][...] = right
    assert wrong(buffers) == 0
    monkeypatch.setattr(ops, "accumulate", lambda acc, x, op: None)   # a broken kernel
    buffers, wrong = bench.build("all_reduce", count, np.dtype(dtype), 0, n, 0, True, redop)
    buffers["buf"][...] = inputs[0]   # what it would have left
    assert wrong(buffers) > 0
