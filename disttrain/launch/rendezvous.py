"""Meeting the other ranks: the rendezvous store, who joined, and who is missing.

``disttrain.init()`` (and ``disttrain run``'s own ranks) join in three steps::

    store      a client of the launcher's store (disttrain launch, torchrun), or rank 0
               serves one itself (srun, mpirun, explicit arguments), listening on the master
               address only; on a *derived* port rank 0 takes the first free candidate and
               labels the store with the job's rendezvous id, which the others check
    join       each rank publishes who it is (host, pid: liveness.ProcessInfo) and counts
               itself in; all wait, bounded by the start-up timeout, for the count to reach
               the world size. A rank (or a whole node) that never comes is named by rank
    group      torch.distributed's process group over that store. Should its own set-up
               time out (a rank joined, then stopped), the ranks check in and the silent
               one is named (comm.checkin), instead of Gloo's "Wait timeout" and a key name

Every store call that could wait on an unreachable host is bounded by the start-up timeout.

A derived port and the id label are public (a job id is), so another user of the master's
host could listen first on a candidate with a store that carries this job's id. Rank 0
refuses to go on past such a store (held by another user and carrying our id: an impostor,
named with its uid) instead of moving to the next candidate, and ranks on the master's host
skip stores held by another user. Ranks on other hosts cannot see who holds a port: on
shared nodes, give MASTER_PORT (or use ``disttrain launch`` / torchrun, whose store the
launcher opens before any rank starts).
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket
import time
from typing import Any

import torch.distributed as dist

from disttrain.comm import checkin, liveness, watchdog
from disttrain.launch import netif
from disttrain.launch import store as launch_store
from disttrain.launch.config import LaunchError
from disttrain.launch.placement import Placement

ID_KEY = "disttrain/rendezvous_id"
COUNT_KEY = "disttrain/joined"
_POLL_S = 0.05
_PROBE_S = 2.0  # a candidate port's store must answer within this


class RendezvousError(RuntimeError):
    """This process could not meet the others; the message names who or what is missing,
    ``suspects`` the ranks to blame when they are known."""

    def __init__(self, message: str, suspects: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.suspects = suspects


def open_store(place: Placement, timeout_s: float, agent_store: bool) -> Any:
    """The store of this job: the launcher's (``agent_store``), else rank 0's."""
    if place.master_port is None:
        return dist.HashStore()  # a world of one meets nobody
    addr, port = place.master_addr, place.master_port
    if agent_store:
        return _client(addr, port, timeout_s)
    if place.rendezvous_id is None:
        return _serve(addr, port, timeout_s) if place.rank == 0 else _client(addr, port,
                                                                              timeout_s)
    if place.rank == 0:
        return _serve_candidate(place, timeout_s)
    return _find_candidate(place, timeout_s)


def _client(addr: str, port: int, timeout_s: float) -> Any:
    try:
        return dist.TCPStore(addr, port, None, False,
                             timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except Exception as exc:
        raise RendezvousError(f"could not reach the rendezvous store at {addr}:{port} within "
                              f"{timeout_s:g}s ({_first_line(exc)})") from exc


def _serve(addr: str, port: int, timeout_s: float) -> Any:
    """Rank 0's store, listening on the address the others connect to (not on every
    interface, as TCPStore alone would)."""
    try:
        listener = launch_store.open_listener(addr, port)
        return launch_store.host_store(listener, timeout_s)
    except LaunchError as exc:
        if _in_use(exc):
            raise RendezvousError(f"rank 0 cannot serve the rendezvous on {addr}:{port}: the "
                                  "port is in use (another job?); set MASTER_PORT to a free "
                                  "port") from exc
        raise RendezvousError(f"rank 0 cannot serve the rendezvous on {addr}:{port}: {exc}; "
                              "check MASTER_ADDR (the address of rank 0's node)") from exc


def _in_use(exc: LaunchError) -> bool:
    return "already in use" in str(exc) or str(errno.EADDRINUSE) in str(exc)


def _serve_candidate(place: Placement, timeout_s: float) -> Any:
    """Rank 0 on a derived port: the first free candidate, labelled with the job's id; an
    impostor on a candidate (see the module docstring) is refused, naming it."""
    for port in place.port_candidates():
        try:
            store = _serve(place.master_addr, port, timeout_s)
        except RendezvousError as exc:
            if isinstance(exc.__cause__, LaunchError) and _in_use(exc.__cause__):
                _refuse_impostor(place, port)
                continue  # another job (or another step of this one) has it: the next
            raise
        store.set(ID_KEY, str(place.rendezvous_id))
        return store
    ports = place.port_candidates()
    raise RendezvousError(f"every rendezvous port derived for {place.rendezvous_id} "
                          f"({ports[0]}-{ports[-1]}) is in use on this machine; set "
                          "MASTER_PORT to a free port")


def _refuse_impostor(place: Placement, port: int) -> None:
    """Rank 0 found ``port`` taken: by another user whose store carries this job's id, it is
    an impostor the other ranks could join; refuse rather than serve on the next port."""
    others = listening_uids(port) - {os.geteuid()}
    if others and _probe(place.master_addr, port, str(place.rendezvous_id)) is not None:
        raise RendezvousError(
            f"rendezvous port {port} on {place.master_addr}, derived for "
            f"{place.rendezvous_id}, is held by another user (uid "
            f"{', '.join(map(str, sorted(others)))}) whose store claims to be this job's; "
            "set MASTER_PORT to a free port, and tell the node's administrator")


def listening_uids(port: int) -> set[int]:
    """The users whose sockets listen on TCP ``port`` in this network namespace (from
    /proc/net/tcp and tcp6); empty where that cannot be read."""
    uids = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.read().splitlines()[1:]]
        except OSError:
            continue
        for row in rows:  # sl local_address rem_address st ... uid
            if len(row) > 7 and row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port:
                uids.add(int(row[7]))
    return uids


def _foreign_on_this_host(addr: str, port: int) -> bool:
    """Whether ``addr`` is this host and only other users listen on ``port`` there."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(addr))
    except (OSError, ValueError):
        return False
    if not ip.is_loopback and netif.interface_with_address(str(ip)) is None:
        return False  # another host: who listens there cannot be seen from here
    owners = listening_uids(port)
    return bool(owners) and os.geteuid() not in owners


def _find_candidate(place: Placement, timeout_s: float) -> Any:
    """A rank other than 0 on a derived port: the candidate whose store carries our id.
    Ports nobody listens on are skipped at once (rank 0 may not be up yet: cycle again),
    and on the master's host so are ports only another user listens on."""
    deadline = time.monotonic() + timeout_s
    ports = place.port_candidates()
    while True:
        for port in ports:
            if not _listening(place.master_addr, port):
                continue
            if _foreign_on_this_host(place.master_addr, port):
                continue
            store = _probe(place.master_addr, port, str(place.rendezvous_id))
            if store is not None:
                store.set_timeout(datetime.timedelta(seconds=timeout_s))
                return store
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"no rendezvous store of {place.rendezvous_id} answered at "
                f"{place.master_addr}:{ports[0]}-{ports[-1]} within {timeout_s:g}s: rank 0 did "
                "not start, or cannot be reached from here")
        time.sleep(_POLL_S * 4)


def _listening(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=_PROBE_S):
            return True
    except OSError:
        return False


def _probe(addr: str, port: int, rendezvous_id: str) -> Any | None:
    """A client of the store at ``addr:port`` when it is ours, else None. A listener that
    is not a store at all may never answer: the attempt is abandoned after ``_PROBE_S``."""
    try:
        store = liveness.bounded(lambda: dist.TCPStore(
            addr, port, None, False, timeout=datetime.timedelta(seconds=_PROBE_S),
            wait_for_workers=False), _PROBE_S + 1)
        found = liveness.bounded(
            lambda: bytes(store.get(ID_KEY)) if store.check([ID_KEY]) else b"", _PROBE_S)
    except Exception:
        return None
    return store if found.decode(errors="replace") == rendezvous_id else None


def join(store: Any, rank: int, world_size: int, timeout_s: float,
         ranks_per_node: int | None = None) -> None:
    """Publish this process and wait until all ``world_size`` ranks have; a
    RendezvousError names the ranks that did not come within ``timeout_s`` (and, with
    ``ranks_per_node`` when ranks are numbered node by node, the nodes all of whose ranks
    are missing)."""
    liveness.publish(store, rank)
    deadline = time.monotonic() + timeout_s
    count = _call(store, "add", deadline, COUNT_KEY, 1)
    while count < world_size:
        if time.monotonic() >= deadline:
            missing = _unpublished(store, world_size, deadline)
            raise RendezvousError(f"{_name_missing(missing, ranks_per_node)} did not start "
                                  f"(or did not reach the rendezvous) within {timeout_s:g}s",
                                  tuple(missing))
        time.sleep(_POLL_S)
        count = _call(store, "add", deadline, COUNT_KEY, 0)


def _call(store: Any, method: str, deadline: float, *args: Any) -> Any:
    budget = max(1.0, deadline - time.monotonic())
    try:
        return liveness.bounded(lambda: getattr(store, method)(*args), budget)
    except Exception as exc:
        raise RendezvousError(f"the rendezvous store stopped answering ({_first_line(exc)}); "
                              "the host of rank 0 (or the launcher's) is down or "
                              "unreachable") from exc


def _unpublished(store: Any, world_size: int, deadline: float) -> list[int]:
    keys = [liveness.PROC_KEY + str(r) for r in range(world_size)]
    return [r for r, key in enumerate(keys) if not _call(store, "check", deadline + 5, [key])]


def _name_missing(missing: list[int], ranks_per_node: int | None) -> str:
    """``rank 3``, ``ranks [2, 3] (all of node 1)``."""
    if len(missing) == 1:
        text = f"rank {missing[0]}"
    else:
        text = f"ranks {missing}"
    if ranks_per_node and len(missing) >= ranks_per_node:
        nodes = sorted({r // ranks_per_node for r in missing})
        whole = [n for n in nodes if all(n * ranks_per_node + i in missing
                                         for i in range(ranks_per_node))]
        if whole:
            text += f" (all of node{'s' if len(whole) > 1 else ''} " \
                    f"{', '.join(map(str, whole))})"
    return text


def init_group(backend: str, store: Any, rank: int, world_size: int, timeout_s: float,
               op_timeout_s: float | None = None) -> None:
    """torch.distributed's default group over ``store``, set up within ``timeout_s``; when
    that fails, the error names the silent ranks (see the module docstring). The group's
    own operations then time out after ``op_timeout_s``: the communicator's timeout, so that
    an operation torch still runs after the communicator gave up on it ends about then too
    (a process whose exit waits for it would otherwise wait out the longer start-up one).
    On NCCL, the watchdog's timeout is longer and its error handling set so that
    disttrain's own error comes first (:mod:`disttrain.comm.watchdog`)."""
    watchdog.apply(backend, os.environ)  # NCCL reads it when the group is made
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        if op_timeout_s is not None and hasattr(dist.distributed_c10d, "_set_pg_timeout"):
            group_s = watchdog.group_timeout_s(backend, op_timeout_s)
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=group_s))
    except Exception as exc:
        verdict = checkin.check_in(store, "disttrain/init-failure/", rank,
                                   tuple(range(world_size)),
                                   liveness.read_table(store, range(world_size), 5.0),
                                   min(timeout_s, 4.5) + 0.5)
        raise RendezvousError(f"the process group was not set up within {timeout_s:g}s: "
                              f"{_blame(verdict)} ({_first_line(exc)})",
                              verdict.missing if verdict is not None else ()) from exc


def _blame(verdict: checkin.Verdict | None) -> str:
    if verdict is None:
        return "which rank is missing could not be found out"
    if not verdict.missing:
        return "every rank checked in afterwards"
    known = [f"rank {r} {verdict.notes[r]}" for r in verdict.missing if r in verdict.notes]
    if known:
        return "; ".join(known)
    return (f"rank(s) {list(verdict.missing)} joined but did not finish the set-up (stuck, or "
            "unreachable on the network Gloo uses)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
