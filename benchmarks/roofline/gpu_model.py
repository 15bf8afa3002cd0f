"""The link model of the GPU backends: for each row of an `anyccl bench --device cuda --json` run,
the bytes the busiest GPU sends over its links for the algorithm that library ran at that size
(the routes each anyccl library recorded in the run's meta; runs made before the routes were
recorded are labelled by today's `ipc` policy), the
bus bandwidth that allows at the links' measured rate, and how much of it the row reaches. It
is the roofline the ipc results are held against, and the prediction a scaling run (2, 4, 8
GPUs) is compared with.

    python benchmarks/roofline/gpu_model.py run.json [--sm 368] [--ce 392] [--min-size 1M]

Egress per GPU, in units of N (nccl-tests' size column), n ranks, through NVLink (one link pair
at 2 GPUs; NVSwitch above, where a GPU's links are shared by all its peers, so B is per GPU,
not per pair): all_reduce ring / two shots / copy engines: 2 (n-1)/n; one shot (ipc up to 2
MiB): n-1 all_gather, reduce_scatter, all_to_all: (n-1)/n; broadcast: 1, the ipc root n-1;
send: 1 The model's busbw is B x the op's nccl-tests bus factor / egress: B for every ring-like
algorithm at every n, 2B/n for the one-shot all_reduce, B/(n-1) for the ipc broadcast. B is the
SM-store rate (--sm: kernels, NCCL's included; 367.6 one way) or the copy engines' (--ce: the
ipc all_reduce from 512 MiB; 392.3 per direction both ways at once): defaults measured on 2 x
H200 (`benchmarks/roofline/link_ceiling.py`,
2026-11-23-h200x2-allreduce-copy-engines-ipc-vs-nccl.md). Small sizes are bound by latency,
not by the link; --min-size leaves them out."""

from __future__ import annotations

import argparse
import json

from anyccl import tuning
from anyccl._units import parse_size
from anyccl.backends.ipc.routes import NCCL, Routes
from anyccl.tools.bench import bus_factor


def ipc_policy(n: int) -> Routes:
    """The `ipc` policy's routes on `n` GPUs (the tuning table's thresholds), for runs that
    recorded none."""
    return Routes.kernels(tuning.value("ipc.ll_max"), tuning.value("ipc.one_shot_max"),
                          tuning.value("ipc.ce_min"), "policy ipc",
                          ll_two_shot_max=tuning.value("ipc.ll_two_shot_max"), ranks=n)


EGRESS = {"two_shot": "two shots", "copy_engines": "copy engines"}


def recorded_routes(meta: dict) -> dict[str, Routes]:
    """library name -> the routes it ran with, as the run recorded them (meta "routes")."""
    return {name: Routes.from_json(spans, name) for name, spans in meta.get("routes", {}).items()}


def algorithm(library: str, routes: dict[str, Routes], op: str, size: int,
              n: int) -> tuple[str, float]:
    """(algorithm, egress per GPU in units of N) for `op` of nccl-tests size `size`, run by
    `library` with its recorded `routes` (an anyccl library without any: the ipc policy's;
    anyccl on its nccl backend and any other library: NCCL)."""
    f = (n - 1) / n
    kernels = library.startswith("anyccl") and not library.endswith("-nccl")  # anyccl-nccl: NCCL
    table = routes.get(library) or (ipc_policy(n) if kernels else None)
    per_rank = {"all_gather": size // n, "reduce_scatter": size // n}.get(op, size)
    impl = table.pick("send" if op == "sendrecv" else op, per_rank) if table else NCCL
    if op == "all_reduce":
        if impl == "one_shot":
            return "ipc one shot", n - 1.0
        if impl == "low_latency":   # lines: 8 bytes of data in 16
            return "ipc one shot of lines", 2 * (n - 1.0)
        if impl == "low_latency_two_shot" and n > 2:
            return "ipc two shots of lines", 4 * f
        if impl != NCCL:
            return f"ipc {EGRESS[impl]}", 2 * f
        return "nccl", 2 * f
    if op == "broadcast":
        return ("ipc root push", n - 1.0) if impl != NCCL else ("nccl", 1.0)
    if op == "sendrecv":
        return ("ipc" if impl != NCCL else "nccl"), 1.0
    if impl == "copy_engines":   # reduce_scatter, all_gather: the ring's n - 1 steps
        return "ipc copy engines", f
    return ("ipc" if impl != NCCL else "nccl"), f


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--sm", type=float, default=368.0,
                        help="GB/s per direction by SM stores (kernels, NCCL)")
    parser.add_argument("--ce", type=float, default=392.0,
                        help="GB/s per direction by the copy engines")
    parser.add_argument("--min-size", default="1M")
    args = parser.parse_args()
    data = json.load(open(args.json))
    n, routes = data["meta"]["ranks"], recorded_routes(data["meta"])
    print(f"{n} GPUs; B = {args.sm:g} GB/s by SM stores, {args.ce:g} by copy engines "
          f"(per direction, per GPU)\n")
    print("| op | size | library | algorithm | egress per GPU (x N) | model busbw (GB/s) | "
          "measured busbw | of model |")
    print("|---|---|---|---|---|---|---|---|")
    for r in data["rows"]:
        if r["busbw"] is None or r["size"] < parse_size(args.min_size):
            continue
        if r["variant"] != ("in-place" if r["op"] in ("all_reduce", "broadcast") else
                            "out-of-place") and r["op"] != "sendrecv":
            continue
        name, egress = algorithm(r["library"], routes, r["op"], r["size"], n)
        link = args.ce if name == "ipc copy engines" else args.sm
        model = link * bus_factor(r["op"], n) / egress
        size = r["size"]
        shown = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"| {r['op']} | {shown} | {r['library']} | {name} | {egress:.2f} | {model:.1f} | "
              f"{r['busbw']:.1f} | {100 * r['busbw'] / model:.0f}% |")


if __name__ == "__main__":
    main()
