"""Which network interface Gloo should use: the one this host reaches the master through.

Gloo binds to the address its host name resolves to, and falls back to loopback when that
address is not local (containers, network namespaces, hosts whose name maps to 127.0.1.1).
Peers on other machines are then told to connect to 127.0.0.1 and time out. The address
the kernel would use as the source of a packet to MASTER_ADDR is, by construction, one the
other nodes can reach back (at least when they share a network with the master), so its
interface is a better default. GLOO_SOCKET_IFNAME, when set, always wins.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


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


def gloo_interface_for(master_addr: str) -> str | None:
    """The interface to reach ``master_addr`` through, or None when loopback will do (or
    nothing better can be found)."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(master_addr)).is_loopback:
            return None
    except (OSError, ValueError):
        return None
    source = route_source_address(master_addr)
    if source is None or ipaddress.ip_address(source).is_loopback:
        return None
    return interface_with_address(source)
