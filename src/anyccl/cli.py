"""The `anyccl` command."""

from __future__ import annotations

import argparse
import sys


def _run(ns: argparse.Namespace) -> int:
    from .launch import run

    if ns.nprocs < 1:
        print(f"anyccl run: -n {ns.nprocs}: need at least one rank", file=sys.stderr)
        return 2
    if ns.module:
        return run(ns.nprocs, ns.module, ns.args, module=True, backend=ns.backend,
                   tag_output=ns.tag_output)
    if not ns.args:
        print("anyccl run: name a script to run (or -m module)", file=sys.stderr)
        return 2
    return run(ns.nprocs, ns.args[0], ns.args[1:], backend=ns.backend, tag_output=ns.tag_output)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="anyccl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"anyccl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start N ranks of a script on this machine")
    run.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    run.add_argument("--backend", help="shm (default); sets ANYCCL_BACKEND for the ranks")
    run.add_argument("--tag-output", action="store_true", help="prefix each line with its rank")
    run.add_argument("-m", dest="module", help="run a module, as python -m does")
    run.add_argument("args", nargs=argparse.REMAINDER, help="script.py and its arguments")
    run.set_defaults(handler=_run)
    sub.add_parser("bench", add_help=False,
                   help="nccl-tests style measurements (anyccl bench --help)")
    sub.add_parser("viz", add_help=False,
                   help="pictures of what a collective does (anyccl viz --help)")
    info = sub.add_parser("info", help="versions, backends, GPUs and their links")
    info.set_defaults(handler=lambda ns: _info())
    return parser


def _info() -> int:
    from .tools.info import main as info

    return info()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser: its options must not meet `anyccl`'s
        from .tools.bench import main as bench

        return bench(argv[1:])
    if argv[:1] == ["viz"]:
        from .tools.viz import main as viz

        return viz(argv[1:])
    ns = build_parser().parse_args(argv)
    return ns.handler(ns)


if __name__ == "__main__":
    sys.exit(main())
