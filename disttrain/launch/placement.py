"""Where one process stands in a job: the :class:`Placement` every launcher contract yields.

The contracts (``env`` for torchrun's variables, ``slurm`` for srun's, ``mpi`` for mpirun's)
each read their variables into a :class:`PartialPlacement`; ``env.resolve_placement`` fills
the rest and checks it. This module holds only those shared types and rules, so the
contract modules import it and not each other.

A port that no variable names is *derived* from something every rank shares (Slurm's job
and step ids, OpenMPI's job id): every rank computes the same candidates without talking to
the others. Two jobs (or two steps of one job) can still land on the same port, so a
derived port comes with its ``rendezvous_id``: rank 0 takes the first free candidate and
labels its store with the id, and the other ranks accept only a store with their id
(:mod:`disttrain.launch.rendezvous`).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

PORT_BASE, PORT_SPAN = 20000, 20000  # derived ports fall in 20000..39999
PORT_CANDIDATES = 8  # rank 0 tries this many derived ports before giving up


class PlacementError(ValueError):
    """The environment does not say (consistently) where this process stands."""


@dataclass(frozen=True)
class Placement:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int | None  # None: a single process, which needs no rendezvous port
    source: str  # "explicit", "torchrun", "slurm", "mpi" or "single"
    rendezvous_id: str | None = None  # set when master_port was derived (see module doc)
    single_host: bool = False  # the launcher says every rank runs on this host

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise PlacementError(f"world size must be ≥ 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise PlacementError(f"rank {self.rank} is out of range for world size "
                                 f"{self.world_size}; ranks are 0..{self.world_size - 1}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise PlacementError(f"local rank {self.local_rank} is out of range for "
                                 f"{self.local_world_size} process(es) on this node")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise PlacementError(f"master port {self.master_port} is not in 1..65535")

    def port_candidates(self) -> tuple[int, ...]:
        """The ports rank 0 may listen on: the given one, or the derived candidates."""
        if self.master_port is None:
            return ()
        if self.rendezvous_id is None:
            return (self.master_port,)
        return port_candidates(self.master_port)


@dataclass
class PartialPlacement:
    """What one source (environment or arguments) says; ``None`` where it says nothing."""

    source: str
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rendezvous_id: str | None = None
    # how to pass an address or port with this launcher, for error messages
    addr_hint: str = "set MASTER_ADDR"
    port_hint: str = "set MASTER_PORT"


def parse_int(name: str, value: str | int, fix: str) -> int:
    """``int(value)``, or a PlacementError naming variable ``name`` and how to fix it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise PlacementError(f"{name}={value!r} is not an integer; {fix}") from None


def require(env: Mapping[str, str], names: tuple[str, ...], why: str) -> None:
    """Raise a PlacementError naming the first of ``names`` missing from ``env``."""
    for name in names:
        if not env.get(name):
            raise PlacementError(f"{name} is not set, but {why}")


def derived_port(rendezvous_id: str) -> int:
    """The first port every rank of the job labelled ``rendezvous_id`` derives alike."""
    return PORT_BASE + zlib.crc32(rendezvous_id.encode()) % PORT_SPAN


def port_candidates(first: int) -> tuple[int, ...]:
    """``first`` and the next ports, wrapping inside the derived range."""
    offset = (first - PORT_BASE) % PORT_SPAN
    return tuple(PORT_BASE + (offset + k) % PORT_SPAN for k in range(PORT_CANDIDATES))
