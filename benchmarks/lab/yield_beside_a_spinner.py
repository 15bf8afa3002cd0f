"""An experiment: what share of a core does a waiting loop get when it shares that core with a
process that spins without ever yielding it? Each pairing runs its processes pinned to one
core for --seconds, and prints the CPU seconds each got (os.times) and how late a 10 ms sleep
on the same core woke up:

- `spin`: a loop that never gives the core away (what an MPI library's blocking call or a
  neighbour's busy job does);
- `yield`: a loop that calls sched_yield at every turn (what a wait of a rank does on a host
  with more ranks than cores, to hand the core to the rank it waits for);
- `nap`: a loop that sleeps 100 us at every turn.

On Linux's EEVDF scheduler (6.6 and later) `yield` beside `spin` gets well under 1% of the
core, while `nap` gets its wake-ups served at once: a yielding wait must end soon and sleep.

    python benchmarks/lab/yield_beside_a_spinner.py [--seconds 3] [--core 0]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import time

PAIRINGS = [("spin",), ("yield",), ("spin", "spin"), ("yield", "yield"), ("spin", "yield"),
            ("spin", "nap")]


def loop(kind: str, core: int, seconds: float, out: mp.Queue) -> None:
    os.sched_setaffinity(0, {core})
    end, turns = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        if kind == "yield":
            os.sched_yield()
        elif kind == "nap":
            time.sleep(1e-4)
        turns += 1
    times = os.times()
    out.put((kind, times.user + times.system, turns))


def sleeper(core: int, seconds: float, out: mp.Queue) -> None:
    os.sched_setaffinity(0, {core})
    late, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        time.sleep(0.01)
        late.append(time.perf_counter() - start - 0.01)
    out.put(("sleeper", max(late), sorted(late)[len(late) // 2]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--core", type=int, default=0)
    args = p.parse_args()
    print(f"Linux {platform.release()}, core {args.core}, {args.seconds:g} s per pairing")
    print("| on the core | CPU seconds each (turns) | a 10 ms sleep's lateness, max / median |")
    print("|---|---|---|")
    for pairing in PAIRINGS:
        out: mp.Queue = mp.Queue()
        procs = [mp.Process(target=loop, args=(k, args.core, args.seconds, out))
                 for k in pairing]
        procs.append(mp.Process(target=sleeper, args=(args.core, args.seconds, out)))
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        got = [out.get() for _ in procs]
        loops = ", ".join(f"{k} {cpu:.3f} s ({turns})" for k, cpu, turns in got
                          if k != "sleeper")
        late = next(g for g in got if g[0] == "sleeper")
        print(f"| {' + '.join(pairing)} + a sleeper | {loops} | "
              f"{late[1] * 1e3:.2f} / {late[2] * 1e3:.3f} ms |")


if __name__ == "__main__":
    main()
