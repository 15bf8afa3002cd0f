"""The tuning table: every threshold that picks an algorithm is declared once (anyccl.tuning),
`anyccl info` prints the values in force, ANYCCL_TUNING overrides any of them in one setting,
and a bad override is refused naming the key; every collective stays right wherever the
thresholds lie."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_ranks, suite_backend
from test_collectives import CHECKS

import anyccl
from anyccl import tuning
from anyccl.errors import InvalidArgumentError

SRC = Path(anyccl.__file__).parent

# every shm schedule switched at sizes the collective checks cross: two shots from 256 B, the
# single-copy path from 4 KiB, its chunks and blocks small
EXTREMES = ("shm.one_shot_max=256,shm.direct_min.all_reduce=4K,shm.direct_min.broadcast=4K,"
            "shm.direct_min.all_gather=4K,shm.direct_min.gather=4K,shm.direct_min.scatter=4K,"
            "shm.direct_chunk=64K,shm.direct_block=4K")


def test_an_override_replaces_the_default_of_its_key_alone(monkeypatch):
    monkeypatch.setenv("ANYCCL_TUNING", " shm.one_shot_max=64K , hierarchical.max_chunks=4 ")
    assert tuning.value("shm.one_shot_max") == 64 << 10
    assert tuning.value("hierarchical.max_chunks") == 4
    assert tuning.value("ipc.ce_min") == tuning.TABLE["ipc.ce_min"].default
    overridden = {key for key, _, was_set, _ in tuning.rows() if was_set}
    assert overridden == {"shm.one_shot_max", "hierarchical.max_chunks"}


def test_without_the_setting_every_threshold_has_its_default(monkeypatch):
    monkeypatch.delenv("ANYCCL_TUNING", raising=False)
    assert all(value == tuning.TABLE[key].default and not was_set
               for key, value, was_set, _ in tuning.rows())


@pytest.mark.parametrize("text, named", [
    ("shm.one_shot=64K", "'shm.one_shot=64K' is not key=value with a known key"),
    ("shm.one_shot_max", "'shm.one_shot_max' is not key=value"),
    ("shm.one_shot_max=lots", "shm.one_shot_max='lots' is not valid; expected a size"),
    ("hierarchical.max_chunks=0", "hierarchical.max_chunks='0' is not valid; expected a whole"),
    ("hierarchical.max_chunks=2.5", "hierarchical.max_chunks='2.5' is not valid"),
])
def test_a_bad_override_is_refused_naming_it(monkeypatch, text, named):
    monkeypatch.setenv("ANYCCL_TUNING", text)
    with pytest.raises(InvalidArgumentError, match=re.escape(named)):
        tuning.value("shm.one_shot_max")


def test_a_refusal_lists_the_keys_there_are(monkeypatch):
    monkeypatch.setenv("ANYCCL_TUNING", "nccl.anything=1")
    with pytest.raises(InvalidArgumentError) as info:
        tuning.overrides()
    assert all(key in str(info.value) for key in tuning.TABLE)


def test_anyccl_info_prints_the_table_in_force():
    out = subprocess.run([sys.executable, "-m", "anyccl", "info"], capture_output=True,
                         text=True, timeout=120,
                         env={**__import__("os").environ, "ANYCCL_TUNING": "ipc.ce_min=256M"})
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()
             if line.startswith("  ") and line.split() and line.split()[0] in tuning.TABLE}
    assert set(lines) == set(tuning.TABLE)
    assert "256 MiB (ANYCCL_TUNING)" in lines["ipc.ce_min"]
    assert "128 KiB" in lines["shm.one_shot_max"]
    assert "ipc auto policy" in out.stdout


def test_no_module_keeps_a_size_threshold_of_its_own():
    """Thresholds that pick an algorithm are read from the table, not kept beside the code
    that uses them (what the table replaced, by name)."""
    replaced = ("MIN_BYTES", "ONE_SHOT_MAX_BYTES", "ALL_REDUCE_CHUNK_BYTES",
                "SCRATCH_BLOCK_BYTES", "SLICE_MIN_BYTES", "MAX_CHUNKS", "CHUNK_BYTES",
                "_SPLIT_ALL_REDUCE_BYTES", "ONE_SHOT_BYTES", "CE_BYTES", "IPC_TILE_KB",
                "IPC_LL_KB", "IPC_ONE_SHOT_KB", "IPC_CE_KB", "IPC_CE_CHUNKS")
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for name in replaced:
            assert not re.search(rf"^\s*{name}\s*=", text, re.M), f"{path.name} defines {name}"


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_every_collective_is_right_wherever_the_thresholds_lie(check):
    if suite_backend() != "shm":
        pytest.skip("these thresholds are the shm backend's")
    env = {"ANYCCL_SHM_STAGING_BYTES": str(64 << 10), "ANYCCL_TUNING": EXTREMES}
    assert all(run_ranks(check, 3, env=env, deadline_s=300))


def test_a_bad_override_stops_init_on_every_rank(tmp_path):
    from harness import launch_job

    script = tmp_path / "job.py"
    script.write_text("import os, sys\n"
                      "import anyccl\n"
                      "try:\n"
                      "    anyccl.init()\n"
                      "except anyccl.InvalidArgumentError as exc:\n"
                      f"    with open(os.path.join({str(tmp_path)!r}, f'refused-{{os.getpid()}}'),"
                      " 'w') as f:\n"
                      "        f.write(str(exc))\n")
    done, _ = launch_job(str(script), 2, env={"ANYCCL_TUNING": "shm.one_shot_max=huge"})
    refusals = [p.read_text() for p in tmp_path.glob("refused-*")]   # one file per rank
    assert len(refusals) == 2 and all("shm.one_shot_max='huge'" in r for r in refusals), \
        (refusals, done.stdout + done.stderr)
