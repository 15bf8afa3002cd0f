"""`anyccl run`: output, exit codes, stopping together, and nothing left behind."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import job_segments, new_job_id

SCRIPT_DIR = Path(__file__).parent / "scripts"
SCRIPT = str(SCRIPT_DIR / "rank_behaviour.py")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _launch(n: int, *args: str, tag: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "anyccl", "run", "-n", str(n)]
    if tag:
        cmd.append("--tag-output")
    return subprocess.Popen([*cmd, SCRIPT, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _pids(pid_dir: Path, n: int, timeout_s: float = 30) -> list[int]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        files = list(pid_dir.glob("rank*.pid"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"only {len(list(pid_dir.glob('*.pid')))} of {n} ranks started")


@pytest.fixture
def no_leftovers(tmp_path, monkeypatch):
    """Yields a pid folder; afterwards no rank may be alive and the test's jobs (named by a
    prefix of their own) may have left no segment."""
    prefix = new_job_id()
    monkeypatch.setenv("ANYCCL_JOB_PREFIX", prefix)
    yield tmp_path
    pids = [int(f.read_text()) for f in tmp_path.glob("rank*.pid") if f.read_text()]
    end = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], "orphan rank processes survived the launcher"
    assert not job_segments(prefix), "shared-memory segments left behind"


def test_a_job_names_its_shared_memory_after_the_prefix_it_was_started_with(tmp_path):
    """ANYCCL_JOB_PREFIX tells one's own jobs' segments (/dev/shm/anyccl-<job id>-...) from
    other jobs' on the machine."""
    script = tmp_path / "named.py"
    script.write_text("import anyccl\nc = anyccl.init()\nprint('ID', c.job_id)\nc.barrier()\n")
    prefix = new_job_id()
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2", str(script)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ANYCCL_JOB_PREFIX": prefix})
    assert proc.returncode == 0, proc.stderr
    ids = set(re.findall(r"^ID (\S+)$", proc.stdout, re.M))
    assert len(ids) == 1 and next(iter(ids)).startswith(prefix) and len(ids.pop()) > len(prefix)
    assert not job_segments(prefix)
    bad = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2", str(script)],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "ANYCCL_JOB_PREFIX": "../x"})
    assert bad.returncode != 0 and "ANYCCL_JOB_PREFIX='../x'" in bad.stderr
    assert "letters and digits" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("args, said", [
    (["missing_script.py"], "anyccl run: missing_script.py: no such file (looked in "),
    (["-m", "no_such_module_here"], "anyccl run: -m no_such_module_here: no module of that "
     "name can be imported from "),
    (["--backend", "bogus", SCRIPT, "ok"], "anyccl run: --backend bogus: backend='bogus' is "
     "unknown; available: shm"),
    (["--backend", "mpi", SCRIPT, "ok"], "anyccl run: --backend mpi: the mpi backend's ranks "
     "are started by mpiexec: mpiexec -n N python SCRIPT"),
])
def test_the_launcher_checks_the_job_once_before_starting_any_rank(args, said, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "3", *args],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(said) == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout == ""


def test_without_a_gpu_the_launcher_refuses_a_gpu_backend_before_starting(tmp_path):
    from anyccl import gpu

    if gpu.device_count():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2", "--backend", "nccl",
                           SCRIPT, "ok", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("anyccl run: --backend nccl: nccl runs on CUDA GPUs, and "
                                   "none is visible here")
    assert not list(tmp_path.glob("*.pid"))   # no rank started


@pytest.mark.parametrize("words, got", [
    (["-m", "showargs", "--foo", "-x", "1"], ["--foo", "-x", "1"]),
    (["-m", "showargs", "--", "--foo"], ["--foo"]),
    (["showargs.py", "--foo", "--backend", "x"], ["--foo", "--backend", "x"]),
    (["--tag-output", "--", "showargs.py", "--", "-n"], ["-n"]),
])
def test_the_script_gets_its_own_arguments_as_python_would_pass_them(words, got, tmp_path):
    (tmp_path / "showargs.py").write_text("import sys\nprint('ARGS', sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "1", *words],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(f"ARGS {got!r}"), proc.stdout


def _run_source(tmp_path: Path, n: int, source: str) -> tuple[Path, subprocess.CompletedProcess]:
    """`source` saved as a script and run on `n` ranks by `anyccl run`."""
    script = tmp_path / "job.py"
    script.write_text(source)
    return script, subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", str(n),
                                   str(script)], capture_output=True, text=True, timeout=60)


def test_a_rank_s_traceback_starts_in_the_user_s_code_and_is_never_interleaved(tmp_path):
    """Tracebacks show the user's frames only (no launcher or runpy frames) and reach the
    terminal whole: three ranks raising at once give three intact blocks, each after a line
    naming its rank."""
    script, proc = _run_source(tmp_path, 3, "import anyccl\n\n\ndef deep(k):\n    if k == 0:\n"
                               "        raise ValueError('boom from ' + str(c.rank))\n"
                               "    deep(k - 1)\n\n\nc = anyccl.init()\nc.barrier()\ndeep(30)\n")
    assert proc.returncode == 1
    err = proc.stderr
    assert "_child.py" not in err and "runpy" not in err, err
    blocks = re.findall(r"anyccl run: rank (\d) raised:\nTraceback \(most recent call last\):\n"
                        r"((?:  .*\n)+)ValueError: boom from (\d)\n", err)
    assert len(blocks) >= 1 and all(a == b for a, _, b in blocks), err
    # every traceback follows its header at once: none was cut into by another rank's lines (a
    # rank the launcher stopped while it printed may leave its own traceback unfinished)
    assert err.count("Traceback (most recent call last)") == \
        len(re.findall(r"raised:\nTraceback \(most recent call last\)", err)), err
    for _, frames, _ in blocks:   # the script's frames alone, from its top level down
        assert frames.startswith(f'  File "{script}", line 12, in <module>\n'), frames
        assert "[Previous line repeated 27 more times]" in frames and \
            frames.count("  File ") == frames.count(f'  File "{script}"'), frames


def test_ctrl_c_gives_one_line_per_rank_not_a_traceback(no_leftovers):
    proc = subprocess.Popen([sys.executable, "-m", "anyccl", "run", "-n", "3", SCRIPT, "forever",
                             str(no_leftovers)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    _pids(no_leftovers, 3)
    os.killpg(proc.pid, signal.SIGINT)   # what a Ctrl-C in the terminal does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err, err
    # a line per rank at most (a rank the launcher's SIGTERM reached first says nothing); the
    # rest is the launcher's own: what it did, and the flight records ranks left
    from_ranks = [line for line in err.splitlines()
                  if not line.startswith(("anyccl run:", "  "))]
    assert len(from_ranks) <= 3 and all(line.startswith("KeyboardInterrupt")
                                        for line in from_ranks), err


def test_a_peer_that_closed_and_exited_normally_is_not_said_to_have_died(tmp_path):
    _, proc = _run_source(tmp_path, 2, "import numpy as np, time, anyccl\nc = anyccl.init()\n"
                          "c.barrier()\nif c.rank == 1:\n    c.close()\nelse:\n"
                          "    time.sleep(0.3)\n    c.all_reduce(np.ones(4))\n")
    assert proc.returncode == 1
    assert "PeerLostError: rank 0: rank 1" in proc.stderr, proc.stderr
    assert "died" not in proc.stderr, proc.stderr
    assert "closed its communicator" in proc.stderr


@pytest.fixture
def another_job_beside():
    """A segment of another anyccl job on this machine, appearing while the test runs and
    outliving its leftover check (removed only after it)."""
    path = f"/dev/shm/anyccl-{secrets.token_hex(4)}-w-0-{secrets.token_hex(4)}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


def test_leftover_checks_judge_only_their_own_jobs(another_job_beside, no_leftovers):
    with open(another_job_beside, "wb") as f:   # another user's job starts meanwhile
        f.write(bytes(4096))
    proc = _launch(2, "ok", str(no_leftovers))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_a_clean_job_exits_zero_and_tags_output_with_ranks(no_leftovers):
    proc = _launch(3, "ok", str(no_leftovers), tag=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(line for line in out.splitlines() if "hello" in line) == \
        [f"[rank {r}] hello from rank {r}" for r in range(3)]


@pytest.mark.parametrize("tag", [False, True], ids=["plain", "tagged"])
def test_every_line_a_rank_prints_reaches_the_terminal_whole(no_leftovers, tag):
    proc = _launch(4, "chatty", str(no_leftovers), tag=tag)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    prefix = r"\[rank (\d)\] " if tag else ""
    body = re.compile(prefix + r"(\d) line (\d+) x{30}|" + prefix + r"last words of rank (\d)")
    seen: dict[int, list[int]] = {r: [] for r in range(4)}
    for line in out.splitlines():
        if re.fullmatch(prefix + r"hello from rank \d", line):  # the script's greeting
            continue
        m = body.fullmatch(line)
        assert m, f"a line came out mixed or cut: {line!r}"
        groups = [g for g in m.groups() if g is not None]
        if tag:
            assert groups[0] == groups[1], f"a line was tagged with another rank: {line!r}"
            groups = groups[1:]
        if len(groups) == 2:
            seen[int(groups[0])].append(int(groups[1]))
        else:
            seen[int(groups[0])].append(-1)
    assert all(lines == [*range(300), -1] for lines in seen.values()), "lines lost or reordered"
    tagged = (lambda r: f"[rank {r}] ") if tag else (lambda r: "")
    assert sorted(line for line in err.splitlines() if "to stderr" in line) == \
        [f"{tagged(r)}rank {r} to stderr" for r in range(4)]


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(no_leftovers):
    proc = _launch(3, "exit", str(no_leftovers), "1", "3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    said = [line for line in err.splitlines() if line.startswith("anyccl run: rank")]
    assert said == ["anyccl run: rank 1 failed first: it exited with code 3; the other ranks "
                    "were stopped"], err   # once, not a second time in other words


def test_the_rank_that_refused_its_arguments_is_named_first_though_the_others_fail_before_it(
        no_leftovers):
    proc = _launch(3, "refuse", str(no_leftovers), "2")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    said = [line for line in err.splitlines() if "failed first" in line]
    assert len(said) == 1 and said[0].startswith(
        "anyccl run: rank 2 failed first: it exited with code 1"), err
    assert "rank 2 refused its arguments" in err, err


def test_a_rank_traceback_shows_the_users_call_not_anyccls_insides(no_leftovers):
    """Of anyccl's frames, only the call the user's code made; ANYCCL_FULL_TRACEBACK=1 shows
    all of them."""
    hidden = re.compile(r"^\((\d+) frames? inside anyccl not shown; ANYCCL_FULL_TRACEBACK=1 "
                        r"shows them\)$", re.M)
    _, err = _launch(2, "refuse", str(no_leftovers), "1").communicate(timeout=60)
    frames = re.findall(r'^  File "(.*?)", line \d+, in (\w+)', err, re.M)
    inside = [f for f in frames if "/anyccl/" in f[0]]
    assert hidden.search(err) and inside, err
    assert all(name == "all_reduce" and path.endswith("anyccl/communicator.py")
               for path, name in inside), err   # no engine, backend or argument-check frames
    full = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2", SCRIPT, "refuse",
                           str(no_leftovers), "1"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ANYCCL_FULL_TRACEBACK": "1"})
    assert not hidden.search(full.stderr) and "arguments.py" in full.stderr, full.stderr


def test_a_rank_that_never_arrives_is_named_first_though_the_others_time_out_first(
        no_leftovers):
    proc = subprocess.Popen([sys.executable, "-m", "anyccl", "run", "-n", "3", SCRIPT, "stall",
                             str(no_leftovers), "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ANYCCL_TIMEOUT": "2"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    said = [line for line in err.splitlines() if "failed first" in line]
    assert len(said) == 1 and re.match(
        r"anyccl run: rank 1 failed first: it never arrived at the operation rank [02] timed "
        r"out in; rank [02] then exited with code 1; the other ranks were stopped$",
        said[0]), err
    assert "timed out after" in err and "rank 1 is idle after all_reduce" in err, err


def test_a_backend_named_by_the_environment_is_blamed_on_the_variable(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2", SCRIPT, "ok"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "ANYCCL_BACKEND": "shmm"})
    assert proc.returncode == 2, proc.stderr
    assert "anyccl run: ANYCCL_BACKEND=shmm: backend='shmm' is unknown" in proc.stderr
    assert "--backend" not in proc.stderr


def test_the_rank_the_others_lost_is_named_first_even_when_they_fail_before_it(no_leftovers):
    proc = _launch(3, "slow-exit", str(no_leftovers), "1", "3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "rank 1 failed first: it exited with code 3" in err, err


def test_a_rank_killed_by_sigkill_stops_the_job_within_five_seconds(no_leftovers):
    proc = _launch(4, "kill", str(no_leftovers), "2")
    _pids(no_leftovers, 4)
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < 5 + 1, "the others were not stopped in time"
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert "rank 2 failed first: it was killed by SIGKILL" in err, err


def test_sigterm_to_the_launcher_stops_every_rank(no_leftovers):
    proc = _launch(3, "forever", str(no_leftovers))
    _pids(no_leftovers, 3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "got SIGTERM; stopping all ranks" in err


def test_ctrl_c_stops_every_rank(no_leftovers):
    proc = _launch(2, "forever", str(no_leftovers))
    _pids(no_leftovers, 2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT


def test_ranks_die_with_a_launcher_killed_by_sigkill(no_leftovers):
    proc = _launch(2, "forever", str(no_leftovers))
    _pids(no_leftovers, 2)
    proc.kill()
    proc.communicate(timeout=30)


def test_the_launcher_needs_a_script_and_a_positive_rank_count():
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "0", SCRIPT],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "at least one rank" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "name a script" in proc.stderr


def _in_small_dev_shm(size: str, *cmd: str) -> subprocess.CompletedProcess:
    """Run `cmd` in a private mount namespace whose /dev/shm is a tmpfs of `size`."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to give a job a small /dev/shm of its own")
    mount = f"mount -t tmpfs -o size={size} tmpfs /dev/shm"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", mount],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr.strip()}")
    script = f'{mount} && exec "$0" "$@"'
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                           *cmd], capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("mib, fit", [(5, 0), (13, 2)])
def test_too_small_a_dev_shm_is_an_error_at_init_on_every_rank_never_a_sigbus(mib, fit):
    # Four ranks need 6 MiB each. With 5 MiB none fits, and the 2 MiB each rank's staging
    # touches would have run out mid-collective (SIGBUS); with 13 MiB at most two fit at once
    # (a rank that gives up frees its segment, so which ranks fit varies), and the ranks that
    # did must be told by those that did not.
    proc = _in_small_dev_shm(f"{mib}m", sys.executable, str(SCRIPT_DIR / "shm_no_room.py"), "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(o["code"] == 1 for o in outcome), outcome  # an exception, not a signal
    assert all(o["last"].startswith("anyccl.errors.RendezvousError: rank ") for o in outcome)
    full = [o["last"] for o in outcome if "no room in shared memory" in o["last"]
            and "could not create" not in o["last"]]
    told = [o["last"] for o in outcome if "could not create its shared memory" in o["last"]]
    assert len(full) + len(told) == 4 and len(full) >= (4 if fit == 0 else 1), outcome
    for line in full + told:
        assert "need 4 x 6.004 MiB = 24.02 MiB" in line
        assert "/dev/shm has " in line and f" free of {mib} MiB" in line
        assert "--shm-size" in line and "ANYCCL_SHM_STAGING_BYTES" in line and "mpi" in line


def test_a_job_that_fits_a_small_dev_shm_runs():
    proc = _in_small_dev_shm("30m", sys.executable, str(SCRIPT_DIR / "shm_no_room.py"), "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [{"code": 0, "last": ""}] * 4


_TORCH_SCRIPT = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")      # env://, as under torchrun
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']}/"
      f"{os.environ['LOCAL_WORLD_SIZE']}: {t.item()}", flush=True)
dist.destroy_process_group()
"""


def test_a_torch_distributed_script_starts_under_anyccl_run_as_under_torchrun(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "torch_job.py"
    script.write_text(_TORCH_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "anyccl", "run", "-n", "2", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0 of 2 local 0/2: 3.0",
                                                   "rank 1 of 2 local 1/2: 3.0"], proc.stdout
