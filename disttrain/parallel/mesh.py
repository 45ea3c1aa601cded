"""The device mesh: each rank's place on a grid of named dimensions, and a sub-communicator
per dimension (and per combination asked for).

The dimensions, outermost first (:data:`DIMS`; the last one varies fastest)::

    dp_replicate   data-parallel replicas that all-reduce (DDP; hybrid sharding's copies)
    dp_shard       data-parallel ranks that shard the model state (ZeRO; within a replica)
    pp             pipeline stages
    cp             context parallelism (a sequence split over ranks)
    ep             expert parallelism (mixture-of-experts experts spread over ranks)
    tp             tensor parallelism (innermost: on the fastest links)

``dp`` names the data-parallel dimensions together (dp_replicate × dp_shard: every rank
that reads another shard of the batch). Ranks are laid out row-major with tp innermost
(Megatron-LM's and torchtitan's choice)::

    rank = ((((dp_replicate · S + dp_shard) · PP + pp) · CP + cp) · EP + ep) · TP + tp

so the ranks of one tensor-parallel group are consecutive (one node, where the links are
fast: TP communicates on every layer, on the critical path), a pipeline's stages come next,
and data-parallel replicas are furthest apart (they talk once per step). dp = 2, pp = 2,
tp = 2 on 8 ranks::

                     pp_rank 0        pp_rank 1
    dp_rank 0      [ 0  1 ]  ──▶    [ 2  3 ]        [ ] a tp group (tp_rank 0, 1)
    dp_rank 1      [ 4  5 ]  ──▶    [ 6  7 ]        ──▶ pp groups: (0, 2), (1, 3), ...
                                                    dp groups: (0, 4), (1, 5), ...

:class:`MeshShape` is pure data (coordinates, group membership) and is tested without
processes; :func:`build_mesh` makes the sub-communicators. ``Communicator.new_group`` is a
collective among a group's members, so every rank walks the same list in the same order:
every dimension innermost first (tp, ep, cp, pp, dp_shard, dp_replicate), then the
combination ``dp``. A dimension of size 1 has no communicator (None); one that spans every
rank reuses the world communicator. Adding a dimension is one word in :data:`DIMS`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.comm import Communicator

DIMS = ("dp_replicate", "dp_shard", "pp", "cp", "ep", "tp")  # outermost first; tp fastest
COMBINED = {"dp": ("dp_replicate", "dp_shard")}  # names for dimensions taken together
Dims = str | tuple[str, ...]


def _dims(dims: Dims) -> tuple[str, ...]:
    """``dims`` as a tuple of mesh dimensions in mesh order (``"dp"`` expanded)."""
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    out: list[str] = []
    for name in names:
        for dim in COMBINED.get(name, (name,)):
            if dim not in DIMS:
                raise ValueError(f"unknown mesh dimension {name!r}; choose one of "
                                 f"{', '.join((*DIMS, *COMBINED))}")
            out.append(dim)
    return tuple(d for d in DIMS if d in out)


class MeshCoords:
    """One rank's coordinates: ``coords["pp"]``, ``coords.pp_rank``; ``dp_rank`` is the
    rank among the data-parallel ranks (dp_replicate × dp_shard)."""

    def __init__(self, at: dict[str, int], shape: MeshShape) -> None:
        self.at, self._shape = dict(at), shape

    def __getitem__(self, dims: Dims) -> int:
        """The coordinate along ``dims`` taken together (row-major in mesh order)."""
        index = 0
        for dim in _dims(dims):
            index = index * self._shape.size(dim) + self.at[dim]
        return index

    def __getattr__(self, name: str) -> int:
        if name.endswith("_rank") and name[:-5] in (*DIMS, *COMBINED):
            return self[name[:-5]]
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshCoords) and self.at == other.at

    def __hash__(self) -> int:
        return hash(tuple(self.at.items()))

    def __repr__(self) -> str:
        shown = ", ".join(f"{d} {v}" for d, v in self.at.items() if self._shape.size(d) > 1)
        return f"MeshCoords({shown or 'a world of one'})"


class MeshShape:
    """How many ranks each dimension has; their product is the world size. Built by name
    (``MeshShape(dp=2, pp=2, tp=2)``, ``MeshShape(dp_shard=4, dp_replicate=2)``); ``dp``
    alone means dp_replicate (the data-parallel ranks taken together, unsplit)."""

    __slots__ = ("sizes",)
    sizes: tuple[int, ...]  # one per DIMS entry

    def __init__(self, dp: int | None = None, pp: int = 1, tp: int = 1, **sizes: int) -> None:
        unknown = sorted(set(sizes) - set(DIMS))
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {unknown}; choose from "
                             f"{', '.join(DIMS)}")
        given = {"pp": pp, "tp": tp, **sizes}
        if dp is not None:
            if "dp_replicate" in sizes:
                raise ValueError("give dp or dp_replicate (× dp_shard), not both")
            given["dp_replicate"] = dp
        for dim, value in given.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "dp" if dim == "dp_replicate" and dp is not None else dim
                raise ValueError(f"mesh size {flag}={value!r} must be an int ≥ 1 "
                                 f"(--{flag.replace('_', '-')})")
        object.__setattr__(self, "sizes", tuple(given.get(d, 1) for d in DIMS))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("MeshShape is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshShape) and self.sizes == other.sizes

    def __hash__(self) -> int:
        return hash(self.sizes)

    def __repr__(self) -> str:
        shown = ", ".join(f"{d}={n}" for d, n in zip(DIMS, self.sizes) if n > 1)
        return f"MeshShape({shown})"

    @classmethod
    def infer(cls, world_size: int, dp: int | None = None, pp: int | None = None,
              tp: int | None = None, **sizes: int | None) -> MeshShape:
        """The shape for ``world_size`` ranks: missing sizes are 1, and dp takes the rest
        (Megatron's rule); raises with the fix when they do not multiply to the world
        size."""
        fixed = {"pp": 1 if pp is None else pp, "tp": 1 if tp is None else tp,
                 **{k: 1 if v is None else v for k, v in sizes.items()}}
        for name, value in (*fixed.items(), ("dp", 1 if dp is None else dp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an int ≥ 1, got "
                                 f"{value!r}")
        product = 1
        for value in fixed.values():
            product *= value
        named = " × ".join(f"--{k.replace('_', '-')} {v}" for k, v in fixed.items()
                           if v > 1 or k in ("pp", "tp"))
        if dp is None:
            if world_size % product:
                raise ValueError(f"{named} = {product} does not divide the world size "
                                 f"{world_size}; choose sizes whose product divides it (dp "
                                 f"takes the rest)")
            dp = world_size // product
        if dp * product != world_size:
            raise ValueError(f"--dp {dp} × {named} = {dp * product} ranks, but the world has "
                             f"{world_size}; make the product equal the world size (or "
                             f"leave --dp out to infer it)")
        return cls(dp, **fixed)  # type: ignore[arg-type]

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, dims: Dims) -> int:
        """How many ranks ``dims`` have together (``"dp"``: dp_replicate × dp_shard)."""
        return math.prod(self.sizes[DIMS.index(d)] for d in _dims(dims))

    @property
    def dp(self) -> int:
        return self.size("dp")

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def tp(self) -> int:
        return self.size("tp")

    def coords(self, rank: int) -> MeshCoords:
        """``rank``'s coordinate along every dimension."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        at: dict[str, int] = {}
        for dim, size in reversed(list(zip(DIMS, self.sizes))):
            rank, at[dim] = divmod(rank, size)
        return MeshCoords({d: at[d] for d in DIMS}, self)

    def rank_at(self, at: dict[str, int]) -> int:
        """The rank whose coordinates are ``at`` (every dimension; missing ones: 0)."""
        rank = 0
        for dim, size in zip(DIMS, self.sizes):
            value = at.get(dim, 0)
            if not 0 <= value < size:
                raise ValueError(f"{dim}_rank={value} is not in 0..{size - 1}")
            rank = rank * size + value
        return rank

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        """The rank at (dp, pp, tp) on a mesh without cp and ep."""
        shard = self.size("dp_shard")
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank={dp_rank} is not in 0..{self.dp - 1}")
        return self.rank_at({"dp_replicate": dp_rank // shard, "dp_shard": dp_rank % shard,
                             "pp": pp_rank, "tp": tp_rank})

    def groups(self, dims: Dims) -> list[tuple[int, ...]]:
        """Every group along ``dims``: the ranks that differ only in those coordinates,
        ordered by their coordinate along ``dims`` taken together (group rank i has
        coordinate i), groups in increasing rank order."""
        along = _dims(dims)
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(self._group(rank, along), None)
        return list(seen)

    def _group(self, rank: int, along: tuple[str, ...]) -> tuple[int, ...]:
        base = self.coords(rank).at
        members = [base]
        for dim in along:  # row-major over the dimensions taken, in mesh order
            members = [{**m, dim: i} for m in members for i in range(self.size(dim))]
        return tuple(self.rank_at(m) for m in members)

    def group_of(self, rank: int, dims: Dims) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``dims``."""
        return self._group(rank, _dims(dims))


@dataclass(frozen=True)
class DeviceMesh:
    """This rank's view of the mesh: its coordinates and its sub-communicators by
    dimension (None for a size of 1): ``mesh.group("pp")``, ``mesh.group("dp")`` (the data-
    parallel ranks together), ``mesh.tp``, ``mesh.dp_rank``, ``mesh.size("cp")``."""

    shape: MeshShape
    rank: int
    world: Communicator
    subs: dict[tuple[str, ...], Communicator | None]

    def group(self, dims: Dims) -> Communicator | None:
        """The sub-communicator along ``dims`` (made by :func:`build_mesh` for every
        dimension and for ``dp``; others with :meth:`make_group`)."""
        key = _dims(dims)
        if key not in self.subs:
            raise ValueError(f"no group along {key} was made; call mesh.make_group({key}) "
                             f"on every rank first")
        return self.subs[key]

    def make_group(self, dims: Dims) -> Communicator | None:
        """Make (collectively: every rank, in the same order) the group along ``dims``."""
        key = _dims(dims)
        if key not in self.subs:
            self.subs[key] = _make(self.world, self.shape, key)
        return self.subs[key]

    @property
    def coords(self) -> MeshCoords:
        return self.shape.coords(self.rank)

    def size(self, dims: Dims) -> int:
        return self.shape.size(dims)

    def coord(self, dims: Dims) -> int:
        """This rank's coordinate along ``dims`` taken together."""
        return self.coords[dims]

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_rank") and name[:-5] in (*DIMS, *COMBINED):
            return self.coord(name[:-5])
        if name.endswith("_size") and name[:-5] in (*DIMS, *COMBINED):
            return self.size(name[:-5])
        if name in (*DIMS, *COMBINED):
            return self.group(name)
        raise AttributeError(name)

    def communicators(self) -> list[Communicator]:
        """The world and every sub-communicator, each once (their traffic adds up)."""
        unique: dict[int, Communicator] = {id(self.world): self.world}
        for c in self.subs.values():
            if c is not None:
                unique.setdefault(id(c), c)
        return list(unique.values())

    def __repr__(self) -> str:
        return f"DeviceMesh(rank={self.rank}, {self.shape!r}, {self.coords!r})"


def _make(comm: Communicator, shape: MeshShape, dims: tuple[str, ...]) -> Communicator | None:
    """This rank's communicator along ``dims`` (collective over ``comm``)."""
    size = shape.size(dims)
    if size == 1:
        return None
    if size == comm.world_size:
        return comm
    mine: Communicator | None = None
    for members in shape.groups(dims):
        group = comm.new_group(list(members))
        mine = group if group is not None else mine
    return mine


def build_mesh(comm: Communicator, shape: MeshShape) -> DeviceMesh:
    """Split ``comm``'s ranks into the mesh ``shape``. Collective: every rank calls it with
    the same shape (checked first: groups built from different shapes would hang)."""
    if shape.world_size != comm.world_size:
        product = " × ".join(f"{d} {n}" for d, n in zip(DIMS, shape.sizes) if n > 1) or "1"
        raise ValueError(f"mesh {product} = {shape.world_size} ranks, but the communicator "
                         f"has {comm.world_size}; make the product equal the world size")
    check_agreement(comm, list(shape.sizes), f"the mesh shape ({', '.join(DIMS)})")
    subs: dict[tuple[str, ...], Communicator | None] = {}
    for dim in reversed(DIMS):  # the creation order every rank follows: innermost first
        subs[(dim,)] = _make(comm, shape, (dim,))
    dp = _dims("dp")
    split = [d for d in dp if shape.size(d) > 1]
    subs[dp] = (_make(comm, shape, dp) if len(split) == 2 else  # both: a group of its own
                subs[(split[0],)] if split else None)  # else the one that is there, or none
    return DeviceMesh(shape, comm.rank, comm, subs)


def check_agreement(comm: Communicator, values: Sequence[int], what: str, *,
                    fix: str = "every rank must be started with the same settings and the "
                               "same model",
                    error: type[Exception] = ValueError) -> None:
    """Raise ``error`` on every rank if the ranks of ``comm`` disagree about ``values`` (e.g.
    mesh sizes, stage count, micro-batches, balance), which would otherwise hang or mix up
    tensors later; the message lists each rank's values and ends with ``fix``."""
    mine = torch.tensor(list(values), dtype=torch.int64)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    sizes = torch.zeros(comm.world_size, dtype=torch.int64)
    comm.all_gather(sizes, size)
    width = int(sizes.max())
    padded = torch.full((width,), -1, dtype=torch.int64)
    padded[:mine.numel()] = mine
    table = torch.zeros(comm.world_size * width, dtype=torch.int64)
    comm.all_gather(table, padded)
    rows = [tuple(row[:int(n)]) for row, n in
            zip(table.view(comm.world_size, width).tolist(), sizes.tolist())]
    if any(row != rows[0] for row in rows):
        listing = "; ".join(f"rank {comm.global_ranks[r]}: {list(row)}"
                            for r, row in enumerate(rows))
        raise error(f"the ranks disagree about {what} ({listing}); {fix}")
