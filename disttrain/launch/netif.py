"""Which network interface Gloo should use: loopback when every rank runs on this host, else
the one this host reaches the master through.

Gloo binds to the address its host name resolves to, and falls back to loopback when that
address is not local (containers, network namespaces, hosts whose name maps to 127.0.1.1).
A job whose ranks all run on one host needs no network at all, yet would listen on the
host's LAN address, open to anyone who can reach the machine: it is kept on loopback (the
master is 127.0.0.1, or the launcher says every rank is local). Across hosts, peers would be
told to connect to 127.0.0.1 and time out; the address the kernel would use as the source of
a packet to MASTER_ADDR is, by construction, one the other nodes can reach back (at least
when they share a network with the master), so its interface is a better default.
GLOO_SOCKET_IFNAME, when set, always wins.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
LOOPBACK = "127.0.0.1"


def route_source_address(host: str, port: int = 9) -> str | None:
    """The local IPv4 address packets to ``host`` would leave from (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, port))  # UDP connect only picks a route
            return str(sock.getsockname()[0])
    except OSError:
        return None


def interface_with_address(address: str) -> str | None:
    """The name of the interface holding IPv4 ``address``, or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def gloo_interface_for(master_addr: str, single_host: bool = False) -> str | None:
    """The interface Gloo should listen on: loopback's when every rank runs here
    (``single_host``, or a loopback master), else the one to reach ``master_addr`` through;
    None when nothing better than Gloo's own choice can be found."""
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(master_addr)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if loopback or single_host:
        return interface_with_address(LOOPBACK)
    source = route_source_address(master_addr)
    if source is None or ipaddress.ip_address(source).is_loopback:
        return None
    return interface_with_address(source)
