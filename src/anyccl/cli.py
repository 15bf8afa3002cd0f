"""The `anyccl` command."""

from __future__ import annotations

import argparse
import sys


def _run(ns: argparse.Namespace) -> int:
    from .errors import AnycclError
    from .launch import Nodes, run

    if ns.nprocs < 1:
        print(f"anyccl run: -n {ns.nprocs}: need at least one rank", file=sys.stderr)
        return 2
    nodes = None
    if ns.nnodes != 1 or ns.master_addr:
        if ns.nnodes < 1 or not 0 <= ns.node_rank < ns.nnodes:
            print(f"anyccl run: --nnodes {ns.nnodes} --node-rank {ns.node_rank}: the node rank "
                  f"must be in 0..nnodes-1", file=sys.stderr)
            return 2
        if not ns.master_addr or ns.master_port is None:
            print("anyccl run: --nnodes needs --master-addr HOST and --master-port PORT (node "
                  "0's address, where its launcher serves the rendezvous)", file=sys.stderr)
            return 2
        nodes = Nodes(ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port, ns.job_key_file)
    if not ns.module and not ns.args:
        print("anyccl run: name a script to run (or -m module)", file=sys.stderr)
        return 2
    if ns.replace and not ns.keep_going:
        print("anyccl run: --replace needs --keep-going (the others must run on while a "
              "replacement starts)", file=sys.stderr)
        return 2
    target, args = (ns.module, ns.args) if ns.module else (ns.args[0], ns.args[1:])
    try:
        return run(ns.nprocs, target, args, module=bool(ns.module), backend=ns.backend,
                   tag_output=ns.tag_output, nodes=nodes, keep_going=ns.keep_going,
                   replace=ns.replace)
    except AnycclError as exc:
        print(exc, file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="anyccl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"anyccl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start N ranks of a script on this machine")
    run.add_argument("-n", "--nprocs", "--nproc-per-node", type=int, required=True,
                     help="number of ranks (on this machine)")
    run.add_argument("--nnodes", type=int, default=1,
                     help="machines in the job (each runs its own anyccl run)")
    run.add_argument("--node-rank", type=int, default=0, help="this machine's number, 0..nnodes-1")
    run.add_argument("--master-addr", help="node 0's address: it serves the rendezvous there")
    run.add_argument("--master-port", type=int, help="the rendezvous port on node 0 (torch's "
                     "own store, if the script uses one, gets the next port)")
    run.add_argument("--job-key-file", help="a file every node reads the job's secret from "
                     "(node 0 writes it if absent); else ANYCCL_JOB_KEY must be set on every node")
    run.add_argument("--backend", help="shm (default); sets ANYCCL_BACKEND for the ranks")
    run.add_argument("--tag-output", action="store_true", help="prefix each line with its rank")
    run.add_argument("--keep-going", action="store_true",
                     help="when a rank dies, let the others run on (they may `comm.shrink()`) "
                     "instead of stopping them; exit 0 if every rank that was not killed "
                     "exited 0")
    run.add_argument("--replace", action="store_true",
                     help="with --keep-going: start a new process in place of each rank that "
                     "dies (once per rank); its anyccl.init() waits until the others "
                     "`comm.grow()` and returns the grown communicator")
    run.add_argument("-m", dest="module", help="run a module, as python -m does")
    run.add_argument("args", nargs=argparse.REMAINDER, help="script.py and its arguments")
    run.set_defaults(handler=_run)
    sub.add_parser("bench", add_help=False,
                   help="nccl-tests style measurements (anyccl bench --help)")
    sub.add_parser("tune", add_help=False,
                   help="measure this machine's GPU routes for the auto policy (anyccl tune "
                        "--help)")
    sub.add_parser("viz", add_help=False,
                   help="pictures of what a collective does (anyccl viz --help)")
    info = sub.add_parser("info", help="versions, backends, GPUs and their links")
    info.set_defaults(handler=lambda ns: _info())
    return parser


def _info() -> int:
    from .tools.info import main as info

    return info()


def main(argv: list[str] | None = None) -> int:
    """The `anyccl` command. Output cut short by its reader (`anyccl info | head`) ends it
    quietly, as any command-line tool ends."""
    try:
        return _main(argv)
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error
        return 0


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser: its options must not meet `anyccl`'s
        from .tools.bench import main as bench

        return bench(argv[1:])
    if argv[:1] == ["tune"]:
        from .tools.tune import main as tune

        return tune(argv[1:])
    if argv[:1] == ["viz"]:
        from .tools.viz import main as viz

        return viz(argv[1:])
    if argv[:1] == ["run"]:   # the script's own arguments never meet anyccl's parser
        options, target = _split_run(argv[1:])
        ns = build_parser().parse_args(["run", *options])
        ns.args = target
        return ns.handler(ns)
    ns = build_parser().parse_args(argv)
    return ns.handler(ns)


_RUN_VALUED = {"-n", "--nprocs", "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr",
               "--master-port", "--job-key-file", "--backend"}


def _split_run(argv: list[str]) -> tuple[list[str], list[str]]:
    """(anyccl run's options, the script and its arguments): the options end at the script
    (the first word that is no option), after `-m MODULE`, or at `--`. What follows the script
    or the module is its own, passed on as python does (a `--` right after it is dropped)."""
    def own(rest: list[str]) -> list[str]:
        return rest[1:] if rest[:1] == ["--"] else rest

    for i, word in enumerate(argv):
        before = argv[i - 1] if i else ""
        if before == "-m":
            return argv[:i + 1], own(argv[i + 1:])
        if before in _RUN_VALUED:
            continue
        if word == "--":
            rest = argv[i + 1:]
            return argv[:i], rest[:1] + own(rest[1:])
        if not word.startswith("-"):
            return argv[:i], [word, *own(argv[i + 1:])]
    return argv, []


if __name__ == "__main__":
    sys.exit(main())
