"""The rendezvous cannot be made to run code: nothing read from the store is unpickled, and a
store reachable from the network is refused without a job key unless the user opts in."""

from __future__ import annotations

import pickle
import socket

import pytest

from anyccl import bootstrap
from anyccl.backends.ipc.memory import decode_peer, encode_peer
from anyccl.errors import RendezvousError


class _Trap:
    """Unpickling this would create `path`: what an attacker's store entry could do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_peer_memory_entries_round_trip_as_plain_json():
    entry = encode_peer("node1", 1234, bytes(range(64)), bytes(64))
    assert entry.startswith(b"{") and b"node1" in entry
    assert decode_peer(entry, 1) == ("node1", 1234, bytes(range(64)), bytes(64))


def test_a_pickled_peer_entry_is_refused_without_running_it(tmp_path):
    trap = tmp_path / "ran"
    payload = pickle.dumps(("node1", 1, bytes(64), bytes(64), _Trap(str(trap))))
    with pytest.raises(RendezvousError, match="rank 3's entry is not a peer-memory description"):
        decode_peer(payload, 3)
    assert not trap.exists()


@pytest.mark.parametrize("payload", [
    b'{"host": "a", "pid": 1, "data": "00", "sig": "00"}',          # handles of the wrong size
    b'{"host": 1, "pid": 1, "data": "' + b"00" * 64 + b'", "sig": "' + b"00" * 64 + b'"}',
    b'{"host": "a", "pid": "1", "data": "' + b"00" * 64 + b'", "sig": "' + b"00" * 64 + b'"}',
    b'{"host": "a"}', b"[]", b"\xff\xfe", b"",
])
def test_malformed_peer_entries_are_refused(payload):
    with pytest.raises(RendezvousError):
        decode_peer(payload, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def reachable_from_the_network(monkeypatch):
    """Treat 127.0.0.1 as a network address: nothing leaves this machine."""
    monkeypatch.setattr(bootstrap, "_is_loopback", lambda host: False)
    monkeypatch.delenv("ANYCCL_JOB_KEY", raising=False)
    monkeypatch.delenv("ANYCCL_ALLOW_UNAUTHENTICATED_STORE", raising=False)


def test_a_network_store_without_a_job_key_is_refused(reachable_from_the_network):
    port = _free_port()
    with pytest.raises(RendezvousError) as info:
        bootstrap.init(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    message = str(info.value)
    assert "no job key is set" in message and "ANYCCL_JOB_KEY" in message
    assert "ANYCCL_ALLOW_UNAUTHENTICATED_STORE=1" in message
    with socket.socket() as s:  # and nothing was left listening on the port
        s.bind(("127.0.0.1", port))


def test_opting_in_by_name_runs_with_a_warning(reachable_from_the_network, monkeypatch):
    monkeypatch.setenv("ANYCCL_ALLOW_UNAUTHENTICATED_STORE", "1")
    with pytest.warns(RuntimeWarning, match="not authenticated"):
        comm = bootstrap.init(rank=0, world_size=1,
                              init_method=f"tcp://127.0.0.1:{_free_port()}")
    comm.close()


def test_a_job_key_makes_a_network_store_acceptable(reachable_from_the_network, monkeypatch,
                                                    recwarn):
    monkeypatch.setenv("ANYCCL_JOB_KEY", "ab" * 32)
    comm = bootstrap.init(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    comm.close()
    assert not [w for w in recwarn if "authenticated" in str(w.message)]
