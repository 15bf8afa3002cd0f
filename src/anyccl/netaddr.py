"""Which of this machine's addresses other hosts can reach, for the rendezvous store and for
the engines that carry data between hosts.

In order: the interface named by ANYCCL_SOCKET_IFNAME, or by GLOO_SOCKET_IFNAME (the setting
torch's gloo reads, honoured so that one variable serves both); the address this machine's
hostname resolves to, when that is not a loopback address; the first interface with an IPv4
address that is not loopback. Never an address of another machine.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from . import settings
from .errors import RendezvousError

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name`; RendezvousError naming the interfaces
    there are when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            known = ", ".join(n for _, n in socket.if_nameindex())
            raise RendezvousError(f"network interface {name!r} has no IPv4 address here "
                                  f"({exc.strerror}); interfaces: {known}") from None
    return socket.inet_ntoa(packed[20:24])


def named_interface() -> str | None:
    """The interface the user named (ANYCCL_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME), if any:
    its first entry where a comma-separated list is given, as gloo reads it."""
    text = settings.SOCKET_IFNAME.get() or os.environ.get("GLOO_SOCKET_IFNAME", "")
    first = text.split(",")[0].strip()
    return first or None


def reachable_address() -> str:
    """The address of this machine that other hosts should use (see the module docstring)."""
    name = named_interface()
    if name is not None:
        return interface_address(name)
    try:
        resolved = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(resolved).is_loopback:
            return resolved
    except (OSError, ValueError):
        pass
    for _, name in socket.if_nameindex():
        try:
            address = interface_address(name)
        except RendezvousError:
            continue
        if not ipaddress.ip_address(address).is_loopback:
            return address
    raise RendezvousError(f"this machine ({socket.gethostname()}) has no network address other "
                          f"than loopback for other hosts to reach; set "
                          f"{settings.SOCKET_IFNAME.name} to the interface the hosts share")


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) resolves to a loopback address."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False
