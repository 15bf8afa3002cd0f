"""The compiled replay (`_cudacore.replay`) on a machine without a GPU: a stand-in for the CUDA
driver library (built here from the C below, found first by the loader) answers every call at
once and logs it, so the replay's own promises can be checked call by call: what it launches
and on which stream, the ordering it keeps with the Python way's state, the records it makes,
how it retires finished operations, and every case in which it must leave the call to the
Python way with nothing queued. The GPU tests check the same path against the real driver."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

DRIVER = r"""
/* answers like the CUDA driver, logs what it was asked */
#include <stdint.h>
#include <string.h>
enum { LOG = 256 };
static uintptr_t logged[LOG][6];
static int count, capturing_stream, failing_function;
static uintptr_t done_below;
static void note(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d, uintptr_t e, uintptr_t f) {
    if (count < LOG) {
        uintptr_t row[6] = {a, b, c, d, e, f};
        memcpy(logged[count++], row, sizeof row);
    }
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    if ((uintptr_t)f == (uintptr_t)failing_function) return 1;
    note(1, (uintptr_t)f, gx, bx, (uintptr_t)stream, (uintptr_t)params);
    return 0;
}
int cuEventRecord(void *event, void *stream) {
    note(2, (uintptr_t)event, (uintptr_t)stream, 0, 0, 0);
    return 0;
}
int cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
    note(3, (uintptr_t)stream, (uintptr_t)event, 0, 0, 0);
    return 0;
}
int cuEventQuery(void *event) { return (uintptr_t)event < done_below ? 0 : 600; }
int cuStreamIsCapturing(void *stream, int *status) {
    *status = (uintptr_t)stream == (uintptr_t)capturing_stream;
    return 0;
}
int cuCtxGetCurrent(void **context) { *context = (void *)0x1; return 0; }
int cuCtxGetDevice(int *device) { *device = 0; return 0; }
/* the test's controls */
int stub_count(void) { return count; }
uintptr_t stub_logged(int i, int k) { return logged[i][k]; }
void stub_set(int capturing, int failing, uintptr_t done) {
    capturing_stream = capturing, failing_function = failing, done_below = done;
}
"""

SCRIPT = r"""
import ctypes, itertools, json, os, types
driver = ctypes.CDLL("libcuda.so.1")
driver.stub_logged.restype = ctypes.c_size_t
import torch
from anyccl import _cudacore, gpu, torch_core
from anyccl.backends.gpu_queue import GpuQueue
from anyccl.ops import ReduceOp
from anyccl.plans import Plan, Plans
from anyccl.trace import FlightRecorder

assert _cudacore.load(), "the stand-in driver did not load"
gpu._core = _cudacore
handles = itertools.count(1000)
gpu.new_stream = lambda device: next(handles)
gpu.new_event = lambda device: next(handles)
gpu.ensure_context = lambda device: None


def log():
    rows = [tuple(driver.stub_logged(i, k) for k in range(6)) for i in range(driver.stub_count())]
    return [("launch", *r[1:]) if r[0] == 1 else ("record", *r[1:3]) if r[0] == 2 else
            ("wait", *r[1:3]) for r in rows]


queue = GpuQueue(0, "rank 0", lambda: None, rank=0)
queue.retire_every = 4
queue.replay_state = queue._replay_state()
woken = []
queue._wake_watchdog = lambda: woken.append(len(queue._queued))


class Backend:
    def replayer(self):
        return queue

    def runner(self):
        return queue.run


class Args(ctypes.Structure):
    _fields_ = [("words", ctypes.c_uint64 * 4)]


tensor = torch.zeros(6)
launch = gpu.KernelLaunch(0xF00, 3, 512, Args())
plans = Plans()
tag = ("all_reduce", ReduceOp.SUM)
plans._plans[tag + (tensor.data_ptr(), tensor.numel(), tensor.dtype)] = Plan(
    "all_reduce", "24 B", 24, launch, 0, Backend(), queue.run)
recorder = FlightRecorder(0, "test")
numbers = itertools.count(1)
owner = types.SimpleNamespace(timeout_s=30.0)
compiled = plans.compiled(numbers.__next__, recorder.add, owner)
context = list(compiled.args[0])
stream = [7]
context[3] = lambda device: stream[0]          # torch's current stream, as a handle
if os.environ["KEY"] == "methods":
    context[9] = None
else:
    assert context[9] is not None, "the torch core is built, its key function is missing"
replay = lambda t=tensor: _cudacore.replay(tuple(context), tag, t)
out = {"key": repr(context[9])}
driver.stub_set(0, 0, 0)
out["first"] = [replay(), log()]
stream[0] = 8
out["second"] = [replay(), log()[len(out["first"][1]):]]
out["events"] = queue._events[:3]
out["order"] = list(queue._order)
out["woken"] = woken
out["records"] = [(r.name, r.seq, r.args, r.nbytes, r.replayed, r.state)
                  for r in recorder.records()]
out["deadlines"] = [round(item[2] - item[0].issued_at, 6) for item in queue._queued]
driver.stub_set(0, 0, queue._events[2])        # the first two operations finished
out["third"] = [replay(), replay(), len(queue._queued)]
out["states"] = [(r.seq, r.state, r.ended_at is not None) for r in recorder.records()]
seen = len(log())
declined = {}
queue.failure = RuntimeError("aborted")
declined["failed queue"] = replay()
queue.failure = None
words = (ctypes.c_uint64 * 2)()
queue.watch(alarm=(words, 1))
words[1] = 1
declined["alarm up"] = replay()
words[1] = 0
declined["alarm down"] = replay()
queue.watch(alarm=([0, 0], 1))
declined["alarm it cannot read"] = replay()
queue.watch(alarm=(words, 1))
with queue.lock:
    declined["lock held"] = replay()
driver.stub_set(9, 0, 0)
stream[0] = 9
declined["stream captured"] = replay()
stream[0] = 8
driver.stub_set(0, 0xF00, 0)
before = list(queue._order)
declined["launch failed"] = replay()
out["order kept"] = list(queue._order) == before
driver.stub_set(0, 0, 0)
declined["not contiguous"] = replay(torch.zeros(6, 2).t())
declined["another tensor"] = replay(torch.zeros(6))
out["declined"] = declined
out["launches after"] = [row for row in log()[seen:] if row[0] == "launch"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def driver_dir(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in driver")
    where = tmp_path_factory.mktemp("driver")
    (where / "driver.c").write_text(DRIVER)
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", str(where / "driver.c"), "-o",
                    str(where / "libcuda.so.1")], check=True, timeout=120)
    return where


def replayed(driver_dir: Path, key: str) -> dict:
    env = dict(os.environ, LD_LIBRARY_PATH=str(driver_dir), KEY=key)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["methods", "torch core"])
def run(request, driver_dir) -> dict:
    if request.param == "torch core":
        from anyccl import torch_core

        if torch_core.load() is None:
            if "cannot be built" in torch_core.status():
                pytest.skip(torch_core.status())
            pytest.fail(f"the torch core was not built: {torch_core.status()}")
    return replayed(driver_dir, "methods" if request.param == "methods" else "core")


def test_a_replay_launches_the_plans_kernel_on_the_current_stream_and_records_its_event(run):
    ok, calls = run["first"]
    first = run["events"][0]
    assert ok is True
    assert [c[0] for c in calls] == ["launch", "record"]   # nothing to wait for yet
    assert calls[0][1:5] == [0xF00, 3, 512, 7]              # function, blocks, threads, stream
    assert calls[1][1:] == [first, 7]
    assert run["woken"] == [1]                              # the watchdog woken: work arrived


def test_a_replay_on_another_stream_follows_the_previous_operation(run):
    ok, calls = run["second"]
    first, second = run["events"][:2]
    assert ok is True
    assert calls == [["wait", 8, first], ["launch", 0xF00, 3, 512, 8, calls[1][5]],
                     ["record", second, 8]]
    assert run["order"] == [2, 8, second]   # the state the Python way reads next


def test_each_replay_is_numbered_recorded_started_and_followed_with_its_deadline(run):
    assert run["records"][:2] == [["all_reduce", 1, "24 B", 24, True, "started"],
                                  ["all_reduce", 2, "24 B", 24, True, "started"]]
    assert run["deadlines"] == [30.0, 30.0]


def test_every_retire_every_operations_the_finished_ones_are_retired_in_order(run):
    # four queued (retire_every = 4): the two whose events finished are popped and ended
    assert run["third"] == [True, True, 2]
    assert run["states"] == [[1, "done", True], [2, "done", True], [3, "started", False],
                             [4, "started", False]]


def test_the_python_way_takes_every_call_the_replay_cannot_queue_whole(run):
    assert run["declined"] == {
        "failed queue": False, "alarm up": False, "alarm down": True,
        "alarm it cannot read": False, "lock held": False, "stream captured": False,
        "launch failed": False, "not contiguous": False, "another tensor": False}
    assert run["order kept"] is True
    # of the declined calls, none launched anything: the one launch is "alarm down"'s
    assert len(run["launches after"]) == 1


def test_the_tensor_key_comes_from_the_torch_core_where_it_is_built(run, request):
    if "torch core" in request.node.callspec.id:
        assert "capsule" in run["key"]
    else:
        assert run["key"] == "None"
