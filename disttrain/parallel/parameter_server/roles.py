"""Who is a server and who is a worker: a pure function of the rank, the same on every rank.

Workers take the lowest ranks, servers the last S::

    rank:   0        …   W−1          W        …   W+S−1
    role:   worker 0 …   worker W−1   server 0 …   server S−1

so a launcher flag ``--servers S`` (``disttrain launch`` exports it as
``DISTTRAIN_PS_SERVERS``, read by :func:`servers_from_env`) and the world size are all a
process needs to know its role. Workers come first so that rank 0, which logs and reports
the result in every disttrain tool, is a worker, and worker *i* is rank *i* (``--straggler
1:2`` slows worker 1). Every error message names a peer by role and rank ("worker 1
(rank 1)", "server 0 (rank 2)").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

RoleKind = Literal["server", "worker"]
SERVERS_ENV = "DISTTRAIN_PS_SERVERS"  # set by ``disttrain launch --servers S``


@dataclass(frozen=True)
class Role:
    """One rank's role: ``kind`` and its index among the ranks of that kind."""

    kind: RoleKind
    index: int
    rank: int

    def __str__(self) -> str:
        return f"{self.kind} {self.index} (rank {self.rank})"


@dataclass(frozen=True)
class PSRoles:
    """``num_workers`` workers on ranks 0..W−1, ``num_servers`` servers on ranks W..W+S−1."""

    num_servers: int
    num_workers: int

    def __post_init__(self) -> None:
        for name in ("num_servers", "num_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1, got {value!r}: a parameter-server "
                                 f"job needs at least one server and one worker")

    @property
    def world_size(self) -> int:
        return self.num_servers + self.num_workers

    @property
    def server_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.num_workers, self.world_size))

    @property
    def worker_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.num_workers))

    def role(self, rank: int) -> Role:
        """The role of ``rank``; a ValueError if the rank is not part of the job."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is not in this job of {self.num_servers} server(s) "
                             f"and {self.num_workers} worker(s) (ranks 0..{self.world_size - 1})")
        if rank < self.num_workers:
            return Role("worker", rank, rank)
        return Role("server", rank - self.num_workers, rank)

    def server_rank(self, index: int) -> int:
        return self.server_ranks[index]

    def worker_rank(self, index: int) -> int:
        return self.worker_ranks[index]

    def describe(self, rank: int) -> str:
        """``"server 0 (rank 0)"`` / ``"worker 1 (rank 3)"``: how errors name a peer."""
        return str(self.role(rank))


def assign_roles(world_size: int, num_servers: int) -> PSRoles:
    """Split ``world_size`` ranks into ``num_servers`` servers and the rest workers."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"a parameter-server job needs a world size ≥ 2 (one server and one "
                         f"worker at least), got {world_size!r}")
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"num_servers must be an int ≥ 1, got {num_servers!r}")
    if num_servers >= world_size:
        raise ValueError(f"num_servers={num_servers} leaves no worker among {world_size} ranks; "
                         f"use at most {world_size - 1} servers or start more ranks")
    return PSRoles(num_servers, world_size - num_servers)


def servers_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """The number of servers ``disttrain launch --servers S`` announced (``DISTTRAIN_PS_SERVERS``),
    or None when the variable is not set::

        roles = assign_roles(comm.world_size, servers_from_env() or 1)
    """
    value = (os.environ if environ is None else environ).get(SERVERS_ENV)
    if value is None or value == "":
        return None
    try:
        servers = int(value)
    except ValueError:
        servers = 0
    if servers < 1:
        raise ValueError(f"{SERVERS_ENV}={value!r} must be a whole number ≥ 1 (the last that "
                         f"many ranks of the job are parameter servers)")
    return servers
