"""The communicator's one view of who is gone (liveness.py): transports add their ways of
telling, the view remembers every verdict with its first reason and the order found, asks a
slow source no more often than it says, and a composite transport's view takes its parts' in
its own numbering. On every backend, `comm.lost_ranks()` is that view: empty while all live."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from harness import run_ranks

from anyccl.liveness import Liveness, process_alive


def test_a_verdict_holds_with_its_first_reason_in_the_order_found():
    said = [{}, {2: "rank 2 died"}, {}, {1: "rank 1 closed", 2: "rank 2 again"}]
    view = Liveness()
    view.add(lambda: said.pop(0) if said else {})
    assert view.first() is None
    assert view.first() == (2, "rank 2 died")
    assert view.gone() == {2: "rank 2 died"}            # the source forgot it: the view did not
    assert list(view.gone().items()) == [(2, "rank 2 died"), (1, "rank 1 closed")]
    assert view.first() == (2, "rank 2 died")


def test_a_source_is_asked_no_more_often_than_it_says():
    asked = []
    view = Liveness()
    view.add(lambda: asked.append(1) or {}, every_s=3600.0)
    for _ in range(5):
        view.gone()
    assert len(asked) == 1


def test_a_part_is_seen_in_the_whole_numbering_and_a_report_counts():
    part = Liveness()
    part.add(lambda: {1: "rank 1 of this host died"})
    whole = Liveness()
    whole.include(part, [4, 5, 6])   # the part's rank 1 is the whole's rank 5
    whole.report(0, "left out by the shrink")
    assert whole.gone() == {0: "left out by the shrink", 5: "rank 1 of this host died"}


def test_a_process_that_ended_is_not_alive_even_before_it_is_reaped():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert process_alive(os.getpid())
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)   # ended, still a zombie
    assert not process_alive(child.pid)
    child.wait()
    assert not process_alive(child.pid)


def _nobody_lost(comm) -> str:
    comm.barrier()
    return repr(comm.lost_ranks())


@pytest.mark.parametrize("n", [2, 3])
def test_no_rank_is_lost_while_every_rank_runs(n):
    assert run_ranks(_nobody_lost, n) == ["{}"] * n
