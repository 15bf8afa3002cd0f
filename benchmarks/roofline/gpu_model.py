"""The link model of the GPU backends: for each row of an `anyccl bench --device cuda --json` run,
the bytes the busiest GPU sends over its links for the algorithm that library runs at that size
(as the code at hand routes it: runs made before a routing change are labelled by today's), the
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
from anyccl.backends.ipc.backend import routes_to_ipc
from anyccl.tools.bench import bus_factor

# all_reduce's paths by the bytes of the array (the tuning table): one shot up to
# ONE_SHOT_BYTES, two shots above, copy engines from CE_BYTES up
ONE_SHOT_BYTES = tuning.value("ipc.one_shot_max")
CE_BYTES = tuning.value("ipc.ce_min")

# what each library name of a run means: anyccl runs the run's own backend (meta "backend")
KERNELS = {"anyccl-ipc": "ipc", "anyccl-auto": "auto"}


def algorithm(library: str, backend: str, op: str, size: int, n: int) -> tuple[str, float]:
    """(algorithm, egress per GPU in units of N) for `op` of nccl-tests size `size`."""
    f = (n - 1) / n
    policy = KERNELS.get(library) or (backend if library == "anyccl" else "nccl")
    per_rank = {"all_gather": size // n, "reduce_scatter": size // n}.get(op, size)
    kernels = policy in ("ipc", "auto") and op in ("all_reduce", "broadcast", "all_gather",
                                                   "reduce_scatter", "sendrecv") \
        and routes_to_ipc(policy, "send" if op == "sendrecv" else op, per_rank, n)
    if op == "all_reduce":
        if kernels and size <= ONE_SHOT_BYTES:
            return "ipc one shot", n - 1.0
        if kernels:
            return ("ipc copy engines" if size >= CE_BYTES else "ipc two shots"), 2 * f
        return "nccl", 2 * f
    if op == "broadcast":
        return ("ipc root push", n - 1.0) if kernels else ("nccl", 1.0)
    if op == "sendrecv":
        return ("ipc" if kernels else "nccl"), 1.0
    return ("ipc" if kernels else "nccl"), f


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
    n, backend = data["meta"]["ranks"], data["meta"]["backend"].split("cuda:")[-1]
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
        name, egress = algorithm(r["library"], backend, r["op"], r["size"], n)
        link = args.ce if name == "ipc copy engines" else args.sm
        model = link * bus_factor(r["op"], n) / egress
        size = r["size"]
        shown = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"| {r['op']} | {shown} | {r['library']} | {name} | {egress:.2f} | {model:.1f} | "
              f"{r['busbw']:.1f} | {100 * r['busbw'] / model:.0f}% |")


if __name__ == "__main__":
    main()
