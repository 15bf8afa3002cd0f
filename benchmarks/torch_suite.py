"""PyTorch's own distributed test suite on the `anyccl` backend, run as torch's CI runs it.

torch's `test/distributed/test_distributed_spawn.py` runs
`torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase` with
`TestDistBackend` spawning one process per rank. The test module comes from the installed torch
wheel; this file runs it with BACKEND=anyccl given *gloo's* selection: the module is imported
as if BACKEND were "gloo" (so its import-time decorators select and skip exactly as for
gloo), then its BACKEND becomes "anyccl", a string that also equals "gloo" in the module's
own comparisons (`BACKEND == "gloo"`, `BACKEND in [...]`), and every feature set that lists
gloo lists anyccl too. Every process group the tests create is an anyccl group; what torch
itself checks by backend name (`monitored_barrier` is gloo-only) sees "anyccl".

    python benchmarks/torch_suite.py --world-size 2 [--backend gloo] [-k WORD ...]
                                     [--only NAME ...] [--json F]

`-k` keeps the tests whose name contains any of the words given, `--only` those named. The
table printed (and the JSON) has one row per test: passed, failed (with the line of the error
that names it), skipped (with torch's reason), and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import unittest

_BACKEND = os.environ.get("ANYCCL_TORCH_SUITE_BACKEND", "anyccl")


class _GlooSelection(str):
    """The backend's name, equal to "gloo" as well in the test module's comparisons."""

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other) or other == "gloo"

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


os.environ["BACKEND"] = "gloo"   # import-time selection: gloo's
os.environ.setdefault("WORLD_SIZE", "2")
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402

if _BACKEND != "gloo":
    if _BACKEND == "anyccl":
        import anyccl.torch  # noqa: F401 - registers the backend

    distributed_test.BACKEND = _GlooSelection(_BACKEND)
    for _features in DistTestCases.backend_feature.values():
        if "gloo" in _features:
            _features.add(_BACKEND)
    os.environ["BACKEND"] = _BACKEND


class TestDistBackendWithSpawn(distributed_test.TestDistBackend,
                               distributed_test.DistributedTest._DistTestBase):
    """As torch's test_distributed_spawn.py: every test in processes spawned per rank."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


class _Record(unittest.TextTestResult):
    """Keeps each test's outcome, reason and duration."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rows: list[dict] = []
        self._started = 0.0

    def startTest(self, test) -> None:  # noqa: N802 - unittest's names
        self._started = time.monotonic()
        super().startTest(test)

    def _row(self, test, outcome: str, detail: str = "") -> None:
        lines = [line.strip() for line in detail.strip().splitlines()
                 if line.strip() and "PYTORCH_PRINT_REPRO" not in line
                 and not line.startswith(("To execute this test", "python "))]
        errors = [line for line in lines if "Error" in line or "Exception" in line]
        self.rows.append({"test": test._testMethodName, "outcome": outcome,
                          "detail": (errors or lines or [""])[-1][:300],
                          "seconds": round(time.monotonic() - self._started, 2)})

    def addSuccess(self, test) -> None:  # noqa: N802
        super().addSuccess(test)
        self._row(test, "passed")

    def addFailure(self, test, err) -> None:  # noqa: N802
        super().addFailure(test, err)
        self._row(test, "failed", self.failures[-1][1])

    def addError(self, test, err) -> None:  # noqa: N802
        super().addError(test, err)
        self._row(test, "failed", self.errors[-1][1])

    def addSkip(self, test, reason) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self._row(test, "skipped", reason)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=int(os.environ["WORLD_SIZE"]))
    parser.add_argument("--backend", default=_BACKEND, help="anyccl (default) or gloo")
    parser.add_argument("-k", nargs="*", default=[], help="keep tests whose name has a word")
    parser.add_argument("--only", nargs="*", default=[], help="run exactly these tests")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    if args.backend != _BACKEND or str(args.world_size) != os.environ["WORLD_SIZE"]:
        # the spawned ranks re-import this file: the choices must be in the environment
        os.environ["ANYCCL_TORCH_SUITE_BACKEND"] = args.backend
        os.environ["WORLD_SIZE"] = str(args.world_size)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    names = [n for n in unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
             if (not args.k or any(word in n for word in args.k))
             and (not args.only or n in args.only)]
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    started = time.monotonic()
    result = unittest.TextTestRunner(resultclass=_Record, verbosity=1).run(suite)
    took = time.monotonic() - started
    counts = {k: sum(r["outcome"] == k for r in result.rows) for k in ("passed", "failed",
                                                                        "skipped")}
    print(f"\n| test | {args.backend}, {args.world_size} ranks | seconds | detail |")
    print("|---|---|---:|---|")
    for r in result.rows:
        print(f"| {r['test']} | {r['outcome']} | {r['seconds']} | {r['detail']} |")
    print(f"\ntorch {dist.__name__ and __import__('torch').__version__}, backend "
          f"{args.backend}, world size {args.world_size}: {counts['passed']} passed, "
          f"{counts['failed']} failed, {counts['skipped']} skipped in {took:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "world_size": args.world_size,
                       "torch": __import__("torch").__version__, "seconds": took,
                       "rows": result.rows}, f, indent=1)
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
