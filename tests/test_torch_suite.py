"""A part of PyTorch's own distributed test suite, run on the `anyccl` backend as torch's CI
runs it (benchmarks/torch_suite.py; the whole suite's run is recorded in benchmarks/results/).
The part chosen fits CI's time: every test anyccl once failed there, and one test of each
kind of operation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")   # what torch's test modules need

RUNNER = Path(__file__).parent.parent / "benchmarks" / "torch_suite.py"
ONCE_FAILED = ["test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags",
               "test_all_gather_coalesced_simple", "test_all_gather_coalesced_with_empty",
               "test_sparse_all_reduce_sum", "test_barrier_timeout_full_group"]
ONE_OF_EACH = ["test_all_reduce_sum", "test_broadcast", "test_all_gather", "test_scatter",
               "test_reduce_sum", "test_send_recv_any_source", "test_isend",
               "test_all_reduce_coalesced_sum", "test_accumulate_gradients_no_sync"]


@pytest.mark.slow
@pytest.mark.shm_only   # its ranks are torch's processes, whatever the suite's backend
def test_torchs_own_distributed_tests_pass_on_anyccl(tmp_path):
    names = ONCE_FAILED + ONE_OF_EACH
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANYCCL_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    proc = subprocess.run([sys.executable, str(RUNNER), "--world-size", "2", "--json", str(out),
                           "--only", *names], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    rows = {r["test"]: r for r in json.loads(out.read_text())["rows"]} if out.exists() else {}
    ran = {n: rows[n]["outcome"] for n in names if n in rows}
    assert ran == dict.fromkeys(names, "passed"), (ran, proc.stdout[-3000:], proc.stderr[-3000:])
