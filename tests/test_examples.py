"""The examples a newcomer runs first work, and check themselves."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"
pytestmark = pytest.mark.shm_only  # `anyccl run` starts shm jobs; the mpi run is tested below


@pytest.mark.parametrize("n", (1, 2, 4))
@pytest.mark.parametrize("flavour", ("numpy", "torch"))
def test_hello_collectives_runs_every_operation(n, flavour):
    if flavour == "torch":
        pytest.importorskip("torch")
    args = ["--torch"] if flavour == "torch" else []
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", str(n),
                           str(EXAMPLES / "hello_collectives.py"), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all operations checked: OK" in proc.stdout
    assert f"{n} ranks, backend shm" in proc.stdout


def _run_example(n: int, name: str, *args: str, timeout: float = 180):
    return subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", str(n),
                           str(EXAMPLES / name), *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("n", (2, 4))
@pytest.mark.parametrize("example, args, success", [
    ("ping_pong.py", ["--rounds", "3", "--elements", "100000"], "max error 0.0: OK"),
    ("async_send_recv.py", [], "failed as it should"),
    ("gradient_average.py", ["--size", "300000", "--repeat", "2"], "max relative error"),
    ("train_mlp.py", ["--epochs", "20"], "weights identical on every rank: True"),
    ("train_mlp.py", ["--epochs", "20", "--torch"], "(shm, torch on cpu)"),
    ("jax_data_parallel.py", [], "weights identical on every rank: True"),
])
def test_seed_examples_check_themselves_on_cpu(n, example, args, success):
    if example == "train_mlp.py":
        pytest.importorskip("sklearn")
    if example.startswith("jax"):
        pytest.importorskip("jax")
    if "--torch" in args:
        pytest.importorskip("torch")
    proc = _run_example(n, example, *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert success in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]  # the user caused none


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("backend", (None, "mpi"))
def test_gradient_average_runs_under_mpiexec_on_shared_memory_or_the_mpi_backend(backend):
    """Under mpiexec on one host the default is shm; --backend mpi runs on MPI."""
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items() if k != "ANYCCL_BACKEND"}
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable,
                           str(EXAMPLES / "gradient_average.py"), "--size", "200000",
                           *(["--backend", backend] if backend else [])],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(f"({backend or 'shm'}, cpu)") == 2, proc.stdout
    assert proc.stdout.count(": OK") == 2, proc.stdout


@pytest.mark.parametrize("n", (2, 4))
def test_collectives_tour_and_classifier_check_themselves(n, tmp_path):
    pytest.importorskip("matplotlib")
    proc = _run_example(n, "collectives_tour.py", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(list(tmp_path.glob("*-rank*.png"))) == 8 * n
    pytest.importorskip("sklearn")
    proc = _run_example(n, "single_layer_classifier.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "one process:" in proc.stdout and ": OK" in proc.stdout


def test_training_loses_a_rank_and_the_survivors_finish_with_the_same_weights():
    pytest.importorskip("sklearn")
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "ANYCCL_BACKEND"}
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "--keep-going", "-n", "4",
                           str(EXAMPLES / "keep_training.py"), "--steps", "80", "--kill-rank",
                           "2", "--kill-step", "20"], capture_output=True, text=True,
                          timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("lost rank(s) [2]; going on as rank") == 3, out[-3000:]
    assert out.count("weights identical on every survivor: True") == 3, out[-3000:]
    assert "rank 2 was killed by SIGKILL; the other ranks keep going" in out


def test_keep_training_admits_a_replacement_and_all_four_finish_alike():
    """`anyccl run --replace` starts a new process in place of the killed rank; the survivors
    grow back to four at step 40, and the new one trains on from rank 0's step and weights."""
    pytest.importorskip("sklearn")
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "ANYCCL_BACKEND"}
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "--keep-going", "--replace",
                           "-n", "4", str(EXAMPLES / "keep_training.py"), "--steps", "80",
                           "--kill-rank", "2", "--kill-step", "20", "--grow-step", "40"],
                          capture_output=True, text=True, timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "a new process starts in its place, to join when they grow (--replace)" in out
    assert out.count("admitted rank(s) [3] at step 40; now rank") == 3, out[-3000:]
    assert "new process: joined as rank 3 of 4 at step 40" in out, out[-3000:]
    assert out.count("(now ") == 4 and out.count("weights identical on every survivor: True") \
        == 4, out[-3000:]


def test_the_tour_leaves_nothing_in_the_directory_it_runs_in(tmp_path):
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2",
                           str(EXAMPLES / "collectives_tour.py")], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []
    written = {line.split()[-1] for line in proc.stdout.splitlines() if line.endswith(".png")}
    folders = {os.path.dirname(p) for p in written}
    assert len(written) == 16 and len(folders) == 1   # one temporary folder, named in the output
    shutil.rmtree(folders.pop())


def test_anyccl_viz_draws_what_the_collective_did(tmp_path):
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "-m", "anyccl", "viz", "all_to_all", "-n", "3",
                           "--out", str(tmp_path), "--gif"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "all_to_all.png").stat().st_size > 1000
    assert (tmp_path / "all_to_all.gif").stat().st_size > 1000
    bad = subprocess.run([sys.executable, "-m", "anyccl", "viz", "all_sorts"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "not a collective" in bad.stderr


def test_anyccl_viz_without_matplotlib_says_what_to_install_before_starting_ranks(
        monkeypatch, capsys):
    from anyccl.tools import viz

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.delenv("ANYCCL_STORE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert viz.main(["all_reduce", "-n", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("anyccl viz needs matplotlib, which is not installed; install it with "
                   "`pip install \"anyccl[plot]\"` (or `pip install matplotlib`)")


def test_anyccl_version_names_the_installed_version():
    import anyccl

    proc = subprocess.run([sys.executable, "-m", "anyccl", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"anyccl {anyccl.__version__}"
