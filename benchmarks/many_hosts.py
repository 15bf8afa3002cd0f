"""anyccl across hosts against torch's gloo and MPICH, on simulated hosts with shaped links.

    sudo python benchmarks/many_hosts.py --hosts 2 --per-host 2 --rate 2gbit --out FILE.md

Builds the hosts (tests/simhosts.py: network namespaces on a bridge, each with its own hostname,
/dev/shm, IPC and PID namespaces), limits every link to `--rate` in both directions with
`tc ... tbf`, then, in one MPI job started by mpiexec across the hosts:

1. `anyccl bench` with anyccl on shm+gloo and shm+mpi beside torch's gloo and MPICH (mpi4py),
   the libraries alternating round by round at every size (busbw = S * 2(n-1)/n / t);
2. the bytes each host's link sent per all_reduce of 16 MiB, read from the veth counters
   (`/sys/class/net/eth0/statistics`) around 8 all_reduces of each library, against a flat
   ring's 2(n-1)/n * S * (ranks per host) and the hierarchical bound S;

and writes the tables, with the share each library reaches of the link's bound for a
hierarchical all_reduce (each host's link sends 2(H-1)/H * S at the rate one TCP stream
reaches over the shaped links, measured first), into a markdown file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from simhosts import Cluster  # noqa: E402

_BYTES_JOB = r'''
import json, sys, time
import numpy as np
import anyccl
from anyccl.tools.peers import peers

comm = anyccl.init()
size, count, rounds = comm.size, int(sys.argv[1]) // 4, int(sys.argv[2])
libraries = {"anyccl-" + comm.backend: None}
for name in sys.argv[3].split(","):
    libraries[name] = peers()[name.replace("anyccl-", "") if name.startswith("anyccl-")
                              else name](comm, "cpu")

def link():
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        sent = int(f.read())
    with open("/sys/class/net/eth0/statistics/rx_bytes") as f:
        return sent, int(f.read())

x = np.ones(count, np.float32)
found = {}
for name, peer in libraries.items():
    run = (lambda: comm.all_reduce(x)) if peer is None else \
        peer.runner("all_reduce", {"buf": x}, anyccl.ReduceOp.SUM, 0)
    run()
    comm.barrier(); time.sleep(0.5); comm.barrier()
    before = link()
    for _ in range(rounds):
        run()
    comm.barrier(); time.sleep(0.5)
    after = link()
    comm.barrier()
    found[name] = ((after[0] - before[0]) / rounds, (after[1] - before[1]) / rounds)
report = comm.all_gather_object((comm.hosts[comm.rank], comm.local_rank, found))
if comm.rank == 0:
    print("BYTES " + json.dumps(report), flush=True)
for peer in libraries.values():
    if peer is not None:
        peer.close()
comm.close()
'''


_STREAM = r'''
import socket, sys, time
role, total = sys.argv[1], int(sys.argv[2])
if role == "serve":
    with socket.create_server(("0.0.0.0", 29777)) as server:
        print("ready", flush=True)
        conn, _ = server.accept()
        got, started = 0, None
        while got < total:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            started = started or time.perf_counter()
            got += len(chunk)
        print(f"{got / (time.perf_counter() - started) / 1e6:.1f}", flush=True)
else:
    block = bytes(1 << 20)
    with socket.create_connection((sys.argv[3], 29777), timeout=60) as conn:
        for _ in range(total >> 20):
            conn.sendall(block)
'''


def one_stream_mb_s(cluster: Cluster, total: int = 256 << 20) -> float:
    """What one TCP stream carries from h2 to h1 over the shaped links (MB/s)."""
    server = cluster.run(0, [sys.executable, "-c", _STREAM, "serve", str(total)])
    assert server.stdout.readline().strip() == "ready"
    client = cluster.run(1, [sys.executable, "-c", _STREAM, "send", str(total),
                             cluster.addresses[0]])
    client.communicate(timeout=600)
    out, _ = server.communicate(timeout=600)
    return float(out.strip())


def _mpiexec(cluster: Cluster, per_host: int, argv: list[str], env: dict) -> str:
    command = ["mpiexec", "-launcher", "ssh", "-launcher-exec", cluster.ssh_stand_in(),
               "-hosts", ",".join(cluster.names), "-ppn", str(per_host), "-n",
               str(cluster.size * per_host), *argv]
    proc = cluster.run(0, command, env=env)
    out, err = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{out}\n{err[-4000:]}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--rate", default="2gbit")
    p.add_argument("--min", default="1M")
    p.add_argument("--max", default="64M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--ops", default="all_reduce,broadcast,all_gather,reduce_scatter")
    p.add_argument("--out", required=True)
    ns = p.parse_args()
    env = dict(os.environ, ANYCCL_TIMEOUT="900", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("ANYCCL_BACKEND", None)
    with Cluster(ns.hosts) as cluster, tempfile.TemporaryDirectory() as tmp:
        cluster.shape(ns.rate)
        stream = one_stream_mb_s(cluster)
        results = {}
        for op in ns.ops.split(","):
            json_path = os.path.join(tmp, f"{op}.json")
            bench = [sys.executable, "-m", "anyccl.tools.bench", "--op", op, "--min", ns.min,
                     "--max", ns.max, "--factor", "4", "--iters", str(ns.iters), "--warmup", "1",
                     "--rounds", str(ns.rounds), "--backend", "shm+mpi", "--compare",
                     "shm+gloo,torch,mpi", "--json", json_path]
            text = _mpiexec(cluster, ns.per_host, bench, env)
            with open(json_path) as f:
                results[op] = (bench, json.load(f), text)
        job = os.path.join(tmp, "bytes.py")
        with open(job, "w") as f:
            f.write(_BYTES_JOB)
        out = _mpiexec(cluster, ns.per_host, [sys.executable, job, str(16 << 20), "8",
                                              "anyccl-shm+gloo,torch,mpi"], env)
        report = json.loads(next(line for line in out.splitlines()
                                 if line.startswith("BYTES "))[6:])
    write(ns, results, report, stream)
    return 0


def _bounds(n: int, per_host: int) -> tuple[float, float]:
    """Bytes sent per all_reduce, per byte of S: (by each rank of a flat ring over all n ranks,
    2(n-1)/n; by each host's link in a hierarchical all_reduce, 2(H-1)/H for H hosts)."""
    hosts = n // per_host
    return 2 * (n - 1) / n, 2 * (hosts - 1) / hosts


def _label(size: int) -> str:
    """A size in bytes as MiB (KiB below 1 MiB), rounded to the nearest (the bench trims a size
    to whole elements per rank, so 1 MiB over 6 ranks is 16 bytes short of it); "~" marks a size
    that is not whole."""
    shift, unit = (20, "MiB") if round(size / (1 << 20)) >= 1 else (10, "KiB")
    whole = round(size / (1 << shift))
    return f"{whole} {unit}" if size == whole << shift else f"~{whole} {unit}"


def _ratio(bw: dict, a: str, b: str) -> str:
    return f"{bw[a] / bw[b]:.2f}x" if bw.get(a) and bw.get(b) else "-"


def write(ns: argparse.Namespace, results: dict, report: list, stream: float) -> None:
    import platform

    import anyccl

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    n = ns.hosts * ns.per_host
    lines = [f"# {ns.hosts} hosts x {ns.per_host} ranks, links shaped to {ns.rate}: anyccl "
             f"across hosts against torch gloo and MPICH", "",
             f"- command: `sudo python benchmarks/many_hosts.py --hosts {ns.hosts} --per-host "
             f"{ns.per_host} --rate {ns.rate} --min {ns.min} --max {ns.max} --rounds "
             f"{ns.rounds} --iters {ns.iters} --out {ns.out}`",
             f"- commit {commit}; anyccl {anyccl.__version__}; Python {platform.python_version()}"
             f"; {next(iter(results.values()))[1]['meta']['libraries']}",
             f"- machine: {os.cpu_count()} cores, Linux {platform.release()}; hosts are network "
             f"namespaces on one bridge (own hostname, /dev/shm, IPC and PID namespaces), every "
             f"veth limited to {ns.rate} each way by `tc qdisc replace dev ... root tbf rate "
             f"{ns.rate} burst 256kb latency 50ms` (netem is not in this kernel: no added delay)",
             "- each row: the median of the rounds, libraries alternating; busbw = S * 2(n-1)/n "
             "/ t for all_reduce (nccl-tests' factors for the others)",
             f"- one TCP stream from h2 to h1 over the shaped links carried {stream:.1f} MB/s "
             f"(256 MiB); the link bound of an all_reduce below uses it", ""]
    from anyccl.tools.bench import comparison_variant

    for op, (bench, data, _) in results.items():
        main = f"anyccl-{data['meta']['backend']}"   # the job's own communicator
        rows = [dict(r, library=main if r["library"] == "anyccl" else r["library"])
                for r in data["rows"] if r["variant"] == comparison_variant(op)]
        libs = list(dict.fromkeys(r["library"] for r in rows))
        lines += [f"## {op} (busbw, {comparison_variant(op)})", "",
                  f"`mpiexec ... {' '.join(bench[1:])}`", "",
                  "| size | " + " | ".join(f"{lib} busbw GB/s" for lib in libs)
                  + " | shm+mpi / gloo | shm+mpi / MPICH | shm+gloo / gloo | shm+gloo / MPICH |",
                  "|---:|" + "---:|" * (len(libs) + 4)]
        by_size: dict[int, dict[str, dict]] = {}
        for r in rows:
            by_size.setdefault(r["size"], {})[r["library"]] = r
        for size, found in sorted(by_size.items()):
            bw = {lib: found[lib]["busbw"] if lib in found and found[lib]["busbw"] else None
                  for lib in libs}

            lines.append(f"| {_label(size)} | " + " | ".join(
                f"{bw[lib]:.3f}" if bw[lib] else "-" for lib in libs) + " | "
                + " | ".join(_ratio(bw, a, b) for a, b in ((main, "torch"), (main, "mpi"),
                                                       ("anyccl-shm+gloo", "torch"),
                                                       ("anyccl-shm+gloo", "mpi"))) + " |")
        if op == "all_reduce":
            ring, hierarchical = _bounds(n, ns.per_host)
            # busbw when every host link sends at the stream's rate: hierarchical sends
            # `hierarchical` S per host, and busbw counts 2(n-1)/n S
            bound = stream / 1e3 * (2 * (n - 1) / n) / hierarchical
            lines += ["", f"Link bound for a hierarchical all_reduce: busbw {bound:.3f} GB/s "
                      f"(each host link sends {hierarchical:.3f} S at {stream:.1f} MB/s). "
                      "Share of it reached:", "",
                      "| size | " + " | ".join(libs) + " |", "|---:|" + "---:|" * len(libs)]
            for size, found in sorted(by_size.items()):
                lines.append(f"| {_label(size)} | " + " | ".join(
                    f"{found[lib]['busbw'] / bound:.0%}" if lib in found and found[lib]["busbw"]
                    else "-" for lib in libs) + " |")
        lines.append("")
    ring, hierarchical = _bounds(n, ns.per_host)
    lines += ["## bytes each host's link sent per all_reduce of 16 MiB (veth counters)", "",
              f"8 all_reduces of S = 16 MiB per library, counters read around them on every "
              f"host. A hierarchical all_reduce must send {hierarchical:.3f} S per host link "
              f"(reduce-scatter and all-gather between {ns.hosts} hosts); a flat ring over "
              f"{n} ranks sends {ring:.3f} S per rank, so a host whose {ns.per_host} ranks "
              f"all have off-host ring neighbours sends up to {ring * ns.per_host:.3f} S.", "",
              "| host | library | sent per all_reduce (MiB) | sent / S |", "|---|---|---:|---:|"]
    for host, local, found in report:
        if local != 0:
            continue
        for lib, (sent, _received) in found.items():
            lines.append(f"| {host} | {lib} | {sent / 2**20:.2f} | {sent / (16 << 20):.3f} |")
    lines.append("")
    Path(ns.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
