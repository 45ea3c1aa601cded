"""The rendezvous store ``disttrain launch`` hosts on node rank 0, listening on one address.

torch's ``TCPStore`` server listens on every interface (``*:port``) whatever host name it
is given, so anyone who can reach the machine could write keys into a job's rendezvous.
The launcher therefore makes the listening socket itself and hands it to the store
(``master_listen_fd``), bound to the address the workers are told to connect to::

    one node                      127.0.0.1       (loopback: nothing else reaches it)
    several nodes                 --master-addr   (the address the other nodes use)
    --store-bind-addr ADDR        ADDR            (when --master-addr is not one of this
                                                   machine's addresses, e.g. behind NAT;
                                                   0.0.0.0 listens on every interface)

The socket is bound (and the port known) before any worker starts, so a port that is taken
or an address that is not local is an error before anything is spawned.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket
from typing import Any

from disttrain.launch.config import LaunchConfig, LaunchError, port_in_use
from disttrain.launch.env import LOOPBACK

_BACKLOG = 1024  # workers of every node connect at about the same moment


def bind_address(config: LaunchConfig) -> str:
    """The address node rank 0's store listens on (see the module docstring)."""
    return config.store_bind_addr or config.master_addr or LOOPBACK


def open_listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: a free one chosen by the kernel);
    a LaunchError that says what to change when that is impossible."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise LaunchError(f"cannot resolve {host!r}, the address the rendezvous store should "
                          f"listen on ({exc}); check --master-addr / --store-bind-addr") from None
    family, _, _, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        sock.bind(address)
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise _bind_error(host, str(address[0]), port, exc) from None
    return sock


def _bind_error(host: str, resolved: str, port: int, exc: OSError) -> LaunchError:
    if exc.errno == errno.EADDRINUSE and port:
        return port_in_use(port)
    if exc.errno == errno.EADDRNOTAVAIL:
        named = host if host == resolved else f"{host} ({resolved})"
        return LaunchError(
            f"the rendezvous store cannot listen on {named}: it is not an address of this "
            "machine. Run node rank 0 on the machine that --master-addr names or, if the "
            "other nodes reach this one through another address (NAT, a DNS alias), give "
            "this machine's own address with --store-bind-addr (0.0.0.0: every interface)")
    return LaunchError(f"the rendezvous store cannot listen on {host}:{port or '(any)'}: {exc}")


def host_store(listener: socket.socket, timeout_s: float) -> Any:
    """A ``TCPStore`` server accepting on ``listener``, which it takes over (and closes when
    it is destroyed). Returns the store; its port is ``listener``'s."""
    import torch.distributed as dist

    host, port = listener.getsockname()[:2]
    if ipaddress.ip_address(host).is_unspecified:  # the store's own client connects here
        host = LOOPBACK if listener.family == socket.AF_INET else "::1"
    fd = listener.detach()  # from here on the store owns the descriptor
    try:
        return dist.TCPStore(host, port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=fd)
    except Exception as exc:
        try:
            os.close(fd)
        except OSError:
            pass  # the store closed it already
        raise LaunchError(f"could not open the rendezvous store on {host}:{port}: {exc}") from exc
