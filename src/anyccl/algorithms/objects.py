"""Object collectives, built from a communicator's public array collectives: objects travel as
pickles (unpickling runs code, so use them among trusted peers only)."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np


def broadcast_object(comm: Any, obj: Any, src: int) -> Any:
    """Rank `src`'s `obj` on every rank of `comm`: its length, then its pickle."""
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if comm.rank == src else None
    length = np.array([payload.size if payload is not None else 0], np.int64)
    comm.broadcast(length, src)
    data = payload.copy() if payload is not None else np.empty(int(length[0]), np.uint8)
    comm.broadcast(data, src)
    return obj if comm.rank == src else pickle.loads(data.tobytes())


def all_gather_object(comm: Any, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order: the pickles' lengths, then the pickles, each padded
    to the longest."""
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = np.empty(comm.size, np.int64)
    comm.all_gather(lengths, np.array([payload.size], np.int64))
    width = int(lengths.max())
    mine = np.zeros(width, np.uint8)
    mine[:payload.size] = payload
    everything = np.empty(comm.size * width, np.uint8)
    comm.all_gather(everything, mine)
    return [pickle.loads(everything[i * width:i * width + int(n)].tobytes())
            for i, n in enumerate(lengths)]
