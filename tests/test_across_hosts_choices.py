"""What anyccl decides for a job across machines, without simulated hosts: the engine between
hosts, the address other hosts reach, the first node of a SLURM job, and that the GPU backends
never pick peer-memory kernels between hosts (a fake GPU: no CUDA here). test_many_hosts.py runs
the real thing."""

from __future__ import annotations

import pytest

import anyccl
from anyccl import bootstrap, netaddr

pytestmark = pytest.mark.shm_only


@pytest.mark.parametrize("nodelist, first", [
    ("h1", "h1"), ("h[1-3]", "h1"), ("node[07-09,12],gpu3", "node07"),
    ("gpu3,node[07-09]", "gpu3"), ("a-b[010,2]", "a-b010"),
])
def test_the_first_node_of_a_slurm_node_list_serves_the_rendezvous(nodelist, first):
    assert bootstrap._first_node(nodelist) == first


HOSTS = ("h1", "h1", "h2", "h2")
ADDRESSES = ("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2")


def test_ranks_on_several_hosts_get_shared_memory_inside_and_mpi_between_under_mpiexec(
        monkeypatch):
    monkeypatch.setattr(bootstrap, "_launched_by_mpiexec", lambda: True)
    monkeypatch.setattr(bootstrap, "_has_mpi4py", lambda: True)
    name, why = bootstrap._across_hosts("mpi", False, HOSTS, ADDRESSES)
    assert name == "shm+mpi" and "2 hosts under mpiexec" in why
    name, why = bootstrap._across_hosts("shm", True, HOSTS, ADDRESSES)
    assert name == "shm+mpi"
    assert bootstrap._across_hosts("mpi", True, HOSTS, ADDRESSES)[0] == "mpi"  # as named


def test_ranks_on_several_hosts_get_gloo_between_hosts_elsewhere(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(bootstrap, "_launched_by_mpiexec", lambda: False)
    name, why = bootstrap._across_hosts("shm", False, HOSTS, ADDRESSES)
    assert name == "shm+gloo" and "gloo between hosts" in why
    with pytest.raises(anyccl.RendezvousError, match="rank 3 found no network address"):
        bootstrap._across_hosts("shm", False, HOSTS, ADDRESSES[:3] + ("",))


def test_without_mpi_or_torch_the_error_names_both_ways(monkeypatch):
    monkeypatch.setattr(bootstrap, "_launched_by_mpiexec", lambda: False)
    monkeypatch.setattr(bootstrap.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(anyccl.UnsupportedError, match="with MPI .* or with torch's gloo"):
        bootstrap._across_hosts("shm", False, HOSTS, ADDRESSES)


def test_the_interface_named_by_anyccl_or_gloo_gives_the_address_other_hosts_reach(
        monkeypatch):
    monkeypatch.delenv("ANYCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert netaddr.reachable_address() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    monkeypatch.setenv("ANYCCL_SOCKET_IFNAME", "lo")     # anyccl's own wins
    assert netaddr.reachable_address() == "127.0.0.1"
    monkeypatch.setenv("ANYCCL_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(anyccl.RendezvousError, match="'no-such-if0' has no IPv4 address.*lo"):
        netaddr.reachable_address()


class _Made(Exception):
    """What the fake GPU backends raise to say which one the choice made."""


@pytest.mark.parametrize("policy", ["ipc", "auto"])
@pytest.mark.parametrize("hosts, expected", [
    (("h1", "h1", "h2", "h2"), "nccl"), (("h1", "h1", "h1", "h1"), "kernels"), ((), "kernels")])
def test_gpu_arrays_across_hosts_never_get_peer_memory_kernels(monkeypatch, policy, hosts,
                                                               expected):
    from anyccl.backends.ipc import backend as ipc
    from anyccl.backends.registry import GpuContext

    def nccl(*args, **kwargs):
        raise _Made("nccl")

    def kernels(*args, **kwargs):
        raise _Made("kernels")

    monkeypatch.setattr(ipc.gpu, "set_device", lambda device: None)
    monkeypatch.setattr(ipc.NcclBackend, "create", staticmethod(nccl))
    monkeypatch.setattr(ipc.IpcBackend, "create", staticmethod(kernels))
    host = type("HostBackend", (), {"hosts": hosts, "lost_peer": lambda self: None})()
    ctx = GpuContext(store=None, key="k", rank=0, size=4, device=0, label="rank 0", timeout_s=5,
                     host=host, meet=lambda: None)
    with pytest.raises(_Made, match=expected):
        ipc.creator(policy)(ctx)
