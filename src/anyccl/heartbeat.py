"""Signs of life between hosts: how a rank learns that a peer on another machine is gone when
no connection tells it (a host that drops off the network sends nothing, not even a reset).

Every rank of a job that spans hosts adds 1 to its counter `beat/<rank>` in the job's store
every half second, from a thread of its own. While some wait of this rank has gone on for a
while, the same thread also reads every peer's counter; a peer whose counter has not moved for
ANYCCL_PEER_SILENCE seconds (while the store itself answered) is lost, and the waiting rank
raises PeerLostError naming it and its host. When the store stops answering, this rank is the
one that may be cut off: its errors say so. The waiting loops never touch the store.
"""

from __future__ import annotations

import threading
import time

from .store import Store

PERIOD_S = 0.5
QUIET_S = 3 * PERIOD_S   # at a deadline: a counter still for this long, while watched, is lost


class Heartbeat:
    """This process's heartbeat in the job's store, and what it saw of its peers'."""

    def __init__(self, store: Store, rank: int, hosts: list[str], silence_s: float) -> None:
        self.rank, self.hosts, self.silence_s = rank, hosts, silence_s
        self._store = store
        now = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {r: (-1, now) for r in range(len(hosts))
                                                     if r != rank}
        self._store_answered_at = now
        self._store_error = ""
        self._watch_until = 0.0
        self._window = False   # the peers' counters were read in the current watch
        self._window_opened_at = now
        self._stop = threading.Event()
        self._followed: dict[str, threading.Event] = {}   # communicator -> set once revoked
        self._thread = threading.Thread(target=self._run, daemon=True, name="anyccl-heartbeat")
        self._thread.start()

    def watch(self) -> None:
        """A wait of this rank has gone on for a while: read the peers' counters for the next
        few periods (cheap: called from waiting loops, never blocks)."""
        self._watch_until = time.monotonic() + 4 * PERIOD_S

    def _run(self) -> None:
        beat = 0
        while not self._stop.wait(PERIOD_S):
            try:
                beat = self._store.add(f"beat/{self.rank}", 1)
                if time.monotonic() < self._watch_until:
                    # a new watch knows nothing of the time before it: counting starts now
                    fresh = not self._window
                    if fresh:
                        self._window_opened_at = time.monotonic()
                    for r in list(self._seen):
                        count = self._store.add(f"beat/{r}", 0)
                        if fresh or count != self._seen[r][0]:
                            self._seen[r] = (count, time.monotonic())
                    self._window = True
                else:
                    self._window = False
                for name, revoked in list(self._followed.items()):
                    if not revoked.is_set() and self._store.check(f"revoked/{name}"):
                        revoked.set()
                self._store_answered_at = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the store is gone or unreachable
                self._store_error = str(exc)
                if self._stop.wait(PERIOD_S):
                    return
        del beat

    def silent(self, ranks: list[int], limit_s: float | None = None) -> list[int]:
        """Those of `ranks` (job ranks) whose counter has not moved for `limit_s` (default: the
        silence limit) while watched and while the store answered: lost. Empty while the store
        itself is silent (then it is this rank that cannot tell)."""
        now = time.monotonic()
        if not self._window or now - self._store_answered_at > 2 * PERIOD_S + 1.0:
            return []
        limit = self.silence_s if limit_s is None else limit_s
        return [r for r in ranks if r in self._seen and now - self._seen[r][1] >= limit]

    def lost(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` that are lost: silent for the silence limit, with the ranks of the
        same hosts whose counters also stood still while watched for QUIET_S or more (a host
        that drops off takes all its ranks at once; their last beats differ by up to a
        period)."""
        silent = self.silent(ranks)
        if not silent:
            return []
        hosts = {self.hosts[r] for r in silent}
        quiet = set(self.silent(ranks, QUIET_S))
        return [r for r in ranks if r in silent or r in quiet and self.hosts[r] in hosts]

    def at_deadline(self, ranks: list[int]) -> str:
        """What a timeout of this rank says of its peers `ranks`, whatever deadline fired and
        however long this rank watched before it: the peers whose counters did not move in all
        the time it watched, once that was at least QUIET_S (it watches that long first if it
        had not: the caller waits at most about two seconds); else whether the store stopped
        answering this rank; else ''."""
        give_up = time.monotonic() + QUIET_S + 2 * PERIOD_S
        while True:
            self.watch()
            quiet = self.silent(ranks, QUIET_S)
            if quiet:
                return self.describe(quiet)
            now = time.monotonic()
            if self._window and now - self._window_opened_at >= QUIET_S or now >= give_up \
                    or self.store_silence():
                return self.store_silence()
            time.sleep(PERIOD_S / 5)

    def gone(self, ranks: list[int]) -> dict[int, str]:
        """Those of `ranks` that are lost (`lost`), each with what to say of it: a source of a
        communicator's liveness (liveness.py)."""
        return {r: self.describe([r]) for r in self.lost(ranks)}

    def describe(self, ranks: list[int]) -> str:
        """'ranks 2, 3 on host h2 gave no sign of life for 10.5 s' for lost `ranks`, grouped
        by host."""
        now = time.monotonic()
        by_host: dict[str, list[int]] = {}
        for r in ranks:
            by_host.setdefault(self.hosts[r], []).append(r)
        parts = []
        for host, group in by_host.items():
            quiet = min(now - self._seen[r][1] for r in group)
            who = f"rank {group[0]}" if len(group) == 1 else \
                f"ranks {', '.join(map(str, group))}"
            parts.append(f"{who} on host {host} gave no sign of life for {quiet:.3g} s")
        return "; ".join(parts)

    def store_silence(self) -> str:
        """'' while the store answers; else what to say about it (this host may be cut off)."""
        quiet = time.monotonic() - self._store_answered_at
        if quiet <= 2 * PERIOD_S + 1.0:
            return ""
        return (f"the job's rendezvous store has not answered this rank for {quiet:.3g} s "
                f"({self._store_error or 'no reply'}): this host ({self.hosts[self.rank]}) may "
                f"be the one cut off from the others")

    def follow(self, name: str) -> threading.Event:
        """An event that this thread sets within a period or two of a rank revoking
        communicator `name` (`revoke`) on any host; `forget(name)` when it closes."""
        return self._followed.setdefault(name, threading.Event())

    def forget(self, name: str) -> None:
        self._followed.pop(name, None)

    def revoke(self, name: str) -> None:
        """Tell every rank that follows communicator `name` that this rank revoked it (it is
        shrinking it): their next operation on it fails at once, as on a lost peer, instead of
        waiting on a peer that went on without them (Gloo cannot tell them itself)."""
        self._in_thread(lambda: self._store.set(f"revoked/{name}", str(self.rank).encode()))

    def tell_lost(self, what: str) -> None:
        """Leave in the store why this rank is failing (it lost a peer, or its deadline passed
        waiting across hosts), for the ranks of its own host, which see only that it left;
        gives up after a second."""
        self._in_thread(lambda: self._store.set(f"lost/{self.rank}", what.encode()))

    def lost_said(self, ranks: list[int]) -> tuple[int, str] | None:
        """(rank, what it said) of the first of `ranks` that left in the store why it failed,
        if any (waits at most about a second: the store may be unreachable)."""
        said: list[tuple[int, bytes]] = []

        def read() -> None:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                for r in ranks:
                    if self._store.check(f"lost/{r}"):
                        said.append((r, self._store.get(f"lost/{r}", 1.0)))
                        return
                time.sleep(0.05)
        self._in_thread(read, 1.5)
        return (said[0][0], said[0][1].decode(errors="replace")) if said else None

    @staticmethod
    def _in_thread(fn, limit_s: float = 1.0) -> None:
        def run() -> None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the store is gone: nothing to say
                pass
        helper = threading.Thread(target=run, daemon=True, name="anyccl-heartbeat-store")
        helper.start()
        helper.join(timeout=limit_s)

    def close(self) -> None:
        self._stop.set()
