"""Who holds what: which rank is a server, which keys each server owns, and the copies
between a model's tensors and those keys. All of it is a pure function of the world size,
the number of servers and the tensor shapes, the same on every rank.

**Roles.** Workers take the lowest ranks, servers the last S::

    rank:   0        …   W−1          W        …   W+S−1
    role:   worker 0 …   worker W−1   server 0 …   server S−1

so a launcher flag ``--servers S`` (``disttrain launch`` exports it as
``DISTTRAIN_PS_SERVERS``, read by :func:`servers_from_env`) and the world size are all a
process needs to know its role. Workers come first so that rank 0, which logs and reports
the result in every disttrain tool, is a worker, and worker *i* is rank *i* (``--straggler
1:2`` slows worker 1). Every error message names a peer by role and rank ("worker 1
(rank 1)", "server 0 (rank 2)").

**Key ranges.** All trainable parameters, in ``named_parameters()`` order, are laid end to
end in one flat key space (the key of an element is its offset there). Server s owns the
contiguous range ``[bounds[s], bounds[s+1])``; the ranges have equal sizes up to one row,
because a cut is snapped to the nearest row boundary (a row is ``tensor[i]``: an embedding
row, a weight matrix's output row, one element of a bias). A large tensor is therefore split
across servers, and a row always lives on one server, so sparse row updates never straddle
two::

    keys  0 ─────────────────────────────────────────────────────────── total
          │ users.weight (rows …) │ items.weight (rows …) │ mlp.0.weight │ … │
    S = 2 │◄──────── server 0 ─────────────►│◄──────── server 1 ──────────────►│
                                  cut snapped to a row boundary of items.weight

Servers and workers compute the same partition independently (the HELLO handshake compares
a fingerprint of it). ps-lite partitions keys into server ranges the same way (Li et al.,
OSDI 2014, §3.3; ps-lite uses consistent hashing to also move ranges, which we do not).
:func:`gather_flat` / :func:`scatter_flat` copy between the model and a key range.
"""

from __future__ import annotations

import bisect
import math
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

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


# ----------------------------------------------------------------------
# Key-range partitioning: every parameter element has a key; each server owns one range.

@dataclass(frozen=True)
class TensorSpec:
    """One parameter: its name, shape and whether its rows travel sparsely."""

    name: str
    shape: tuple[int, ...]
    sparse: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_size(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1


@dataclass(frozen=True)
class Segment:
    """The rows ``[row_start, row_end)`` of tensor ``tensor`` that server ``server`` owns,
    stored at global keys ``[start, start + length)``."""

    tensor: int
    server: int
    start: int
    length: int
    row_start: int
    row_end: int


@dataclass(frozen=True)
class Partition:
    """The key layout (``offsets``: where each tensor starts) and the server ranges."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]  # len(specs) + 1 entries; offsets[-1] is the total
    bounds: tuple[int, ...]  # num_servers + 1 entries

    @property
    def num_servers(self) -> int:
        return len(self.bounds) - 1

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def server_range(self, server: int) -> tuple[int, int]:
        return self.bounds[server], self.bounds[server + 1]

    def index(self, name: str) -> int:
        for i, spec in enumerate(self.specs):
            if spec.name == name:
                return i
        raise KeyError(name)

    def segments(self, server: int | None = None, tensor: int | None = None) -> list[Segment]:
        """The non-empty (tensor ∩ server range) pieces, optionally of one server or tensor."""
        result = []
        for t, spec in enumerate(self.specs):
            if tensor is not None and t != tensor:
                continue
            for s in range(self.num_servers) if server is None else [server]:
                lo = max(self.offsets[t], self.bounds[s])
                hi = min(self.offsets[t + 1], self.bounds[s + 1])
                if hi > lo:
                    base, row = self.offsets[t], spec.row_size
                    result.append(Segment(t, s, lo, hi - lo, (lo - base) // row,
                                          (hi - base) // row))
        return result

    def dense_pieces(self, server: int) -> list[tuple[int, int]]:
        """``(offset, length)`` runs of server ``server``'s keys outside sparse tables."""
        pieces: list[tuple[int, int]] = []
        for seg in self.segments(server=server):
            if self.specs[seg.tensor].sparse:
                continue
            if pieces and pieces[-1][0] + pieces[-1][1] == seg.start:
                pieces[-1] = (pieces[-1][0], pieces[-1][1] + seg.length)
            else:
                pieces.append((seg.start, seg.length))
        return pieces

    def slices(self, offset: int, length: int) -> list[tuple[int, int, int]]:
        """Which tensors the keys ``[offset, offset + length)`` cover, in order: triples
        ``(tensor, first, end)`` of element offsets inside each tensor."""
        end, result = offset + length, []
        t = max(0, bisect.bisect_right(self.offsets, offset) - 1)
        while t < len(self.specs) and self.offsets[t] < end:
            lo, hi = max(offset, self.offsets[t]), min(end, self.offsets[t + 1])
            if hi > lo:
                result.append((t, lo - self.offsets[t], hi - self.offsets[t]))
            t += 1
        return result

    def fingerprint(self, extra: str = "") -> int:
        """A 31-bit digest of the layout (and ``extra``), compared in the HELLO handshake."""
        text = repr((self.specs, self.bounds, extra))
        return zlib.crc32(text.encode())


def partition(specs: Sequence[TensorSpec], num_servers: int) -> Partition:
    """Split the keys of ``specs`` into ``num_servers`` contiguous, row-aligned ranges of
    nearly equal size. With more servers than rows some ranges are empty."""
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"num_servers must be an int ≥ 1, got {num_servers!r}")
    offsets = [0]
    for spec in specs:
        offsets.append(offsets[-1] + spec.numel)
    total = offsets[-1]
    bounds = [0]
    for k in range(1, num_servers):
        bounds.append(max(bounds[-1], _snap(specs, offsets, round(k * total / num_servers))))
    bounds.append(total)
    return Partition(tuple(specs), tuple(offsets), tuple(bounds))


def _snap(specs: Sequence[TensorSpec], offsets: list[int], key: int) -> int:
    """The row boundary nearest to ``key`` inside the tensor that holds it."""
    if key >= offsets[-1]:
        return offsets[-1]
    t = bisect.bisect_right(offsets, key) - 1
    row = specs[t].row_size
    rows = round((key - offsets[t]) / row)
    return offsets[t] + min(rows, specs[t].rows) * row


def specs_of(model: nn.Module, sparse_params: Sequence[str] = ()) -> tuple[TensorSpec, ...]:
    """The trainable parameters of ``model`` as specs; names in ``sparse_params`` (embedding
    tables, at least 2-D) are marked sparse. Frozen parameters stay on each worker."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters: nothing to serve")
    names = {n for n, _ in params}
    unknown = [n for n in sparse_params if n not in names]
    if unknown:
        raise ValueError(f"sparse_params {unknown} are not trainable parameters of the model; "
                         f"choose among: {', '.join(sorted(names))}")
    specs = []
    for name, p in params:
        sparse = name in sparse_params
        if sparse and p.dim() < 2:
            raise ValueError(f"sparse parameter {name!r} has shape {tuple(p.shape)}; sparse "
                             f"updates move whole rows of a 2-D (or higher) table")
        specs.append(TensorSpec(name, tuple(p.shape), sparse))
    return tuple(specs)


# ----------------------------------------------------------------------
# Copy between a model's parameter tensors and flat key ranges of the partition.

def gather_flat(tensors: Sequence[torch.Tensor | None], part: Partition, offset: int,
                length: int, dtype: torch.dtype) -> torch.Tensor:
    """The keys ``[offset, offset + length)`` of ``tensors`` (one per spec, in order) as one
    contiguous tensor on their device; a ``None`` tensor (no gradient) reads as zeros."""
    device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    pieces = []
    for t, lo, hi in part.slices(offset, length):
        tensor = tensors[t]
        if tensor is None:
            pieces.append(torch.zeros(hi - lo, dtype=dtype, device=device))
        else:
            pieces.append(tensor.detach().reshape(-1)[lo:hi].to(dtype))
    if not pieces:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous().clone()


def scatter_flat(tensors: Sequence[torch.Tensor], part: Partition, offset: int,
                 values: torch.Tensor) -> None:
    """Write ``values`` (keys ``[offset, offset + len(values))``) into ``tensors`` in place."""
    at = 0
    with torch.no_grad():
        for t, lo, hi in part.slices(offset, values.numel()):
            tensors[t].view(-1)[lo:hi].copy_(values[at:at + hi - lo])
            at += hi - lo
