"""The device mesh: each rank's place in a data × pipeline × tensor grid, and one
sub-communicator per dimension.

Ranks are laid out row-major with the tensor dimension innermost (Megatron-LM's and
torchtitan's choice)::

    rank = (dp_rank · pp + pp_rank) · tp + tp_rank

so the ranks of one tensor-parallel group are consecutive (one node, where the links are
fast: TP communicates on every layer, on the critical path), a pipeline's stages come next,
and data-parallel replicas are furthest apart (they talk once per step). dp = 2, pp = 2,
tp = 2 on 8 ranks::

                     pp_rank 0        pp_rank 1
    dp_rank 0      [ 0  1 ]  ──▶    [ 2  3 ]        [ ] a tp group (tp_rank 0, 1)
    dp_rank 1      [ 4  5 ]  ──▶    [ 6  7 ]        ──▶ pp groups: (0, 2), (1, 3), ...
                                                    dp groups: (0, 4), (1, 5), ...

With tp = 1 this is the pipeline's own order, rank r = stage r % pp of replica r // pp.
:class:`MeshShape` is pure data (coordinates, group membership) and is tested without
processes; :func:`build_mesh` makes the sub-communicators. ``Communicator.new_group`` is a
collective among a group's members, so every rank walks the same list in the same order:
every tp group, then every pp group, then every dp group. A dimension of size 1 has no
communicator (None); one that spans every rank reuses the world communicator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disttrain.comm import Communicator

DIMS = ("dp", "pp", "tp")  # outermost first; the last one varies fastest


@dataclass(frozen=True)
class MeshCoords:
    """One rank's coordinates in the mesh."""

    dp_rank: int
    pp_rank: int
    tp_rank: int


@dataclass(frozen=True)
class MeshShape:
    """How many ranks each dimension has; ``dp · pp · tp`` is the world size."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for dim in DIMS:
            value = getattr(self, dim)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh size {dim}={value!r} must be an int ≥ 1 (--{dim})")

    @classmethod
    def infer(cls, world_size: int, dp: int | None = None, pp: int | None = None,
              tp: int | None = None) -> MeshShape:
        """The shape for ``world_size`` ranks: missing sizes are 1 for pp and tp, and dp
        takes the rest (Megatron's rule); raises with the fix when they do not multiply to
        the world size."""
        pp_, tp_ = 1 if pp is None else pp, 1 if tp is None else tp
        for name, value in (("pp", pp_), ("tp", tp_), ("dp", 1 if dp is None else dp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be an int ≥ 1, got {value!r}")
        if dp is None:
            if world_size % (pp_ * tp_):
                raise ValueError(f"--tp {tp_} × --pp {pp_} = {tp_ * pp_} does not divide the "
                                 f"world size {world_size}; choose sizes whose product "
                                 f"divides it (dp takes the rest)")
            dp = world_size // (pp_ * tp_)
        if dp * pp_ * tp_ != world_size:
            raise ValueError(f"--dp {dp} × --pp {pp_} × --tp {tp_} = {dp * pp_ * tp_} ranks, "
                             f"but the world has {world_size}; make the product equal the "
                             f"world size (or leave --dp out to infer it)")
        return cls(dp, pp_, tp_)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def size(self, dim: str) -> int:
        if dim not in DIMS:
            raise ValueError(f"unknown mesh dimension {dim!r}; choose one of {', '.join(DIMS)}")
        return int(getattr(self, dim))

    def coords(self, rank: int) -> MeshCoords:
        """``rank``'s (dp_rank, pp_rank, tp_rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        rest, tp_rank = divmod(rank, self.tp)
        dp_rank, pp_rank = divmod(rest, self.pp)
        return MeshCoords(dp_rank, pp_rank, tp_rank)

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        for name, value, size in (("dp_rank", dp_rank, self.dp), ("pp_rank", pp_rank, self.pp),
                                  ("tp_rank", tp_rank, self.tp)):
            if not 0 <= value < size:
                raise ValueError(f"{name}={value} is not in 0..{size - 1}")
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """Every group of dimension ``dim``: the ranks that differ only in that coordinate,
        ordered by it (so group rank i has coordinate i), groups in increasing rank order."""
        size = self.size(dim)
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            members = []
            for i in range(size):
                at = {"dp_rank": c.dp_rank, "pp_rank": c.pp_rank, "tp_rank": c.tp_rank}
                at[f"{dim}_rank"] = i
                members.append(self.rank_of(**at))
            seen.setdefault(tuple(members), None)
        return list(seen)

    def group_of(self, rank: int, dim: str) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``dim``."""
        return next(g for g in self.groups(dim) if rank in g)


@dataclass(frozen=True)
class DeviceMesh:
    """This rank's view of the mesh: its coordinates and its sub-communicators (None for a
    dimension of size 1)."""

    shape: MeshShape
    rank: int
    world: Communicator
    dp: Communicator | None
    pp: Communicator | None
    tp: Communicator | None

    @property
    def coords(self) -> MeshCoords:
        return self.shape.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords.dp_rank

    @property
    def pp_rank(self) -> int:
        return self.coords.pp_rank

    @property
    def tp_rank(self) -> int:
        return self.coords.tp_rank

    @property
    def dp_size(self) -> int:
        return self.shape.dp

    @property
    def pp_size(self) -> int:
        return self.shape.pp

    @property
    def tp_size(self) -> int:
        return self.shape.tp

    def communicators(self) -> list[Communicator]:
        """The world and every sub-communicator, each once (their traffic adds up)."""
        unique: dict[int, Communicator] = {}
        for c in (self.world, self.tp, self.pp, self.dp):
            if c is not None:
                unique.setdefault(id(c), c)
        return list(unique.values())

    def __repr__(self) -> str:
        c = self.coords
        return (f"DeviceMesh(rank={self.rank}, dp={self.dp_size}, pp={self.pp_size}, "
                f"tp={self.tp_size}, coords=(dp {c.dp_rank}, pp {c.pp_rank}, tp {c.tp_rank}))")


def build_mesh(comm: Communicator, shape: MeshShape) -> DeviceMesh:
    """Split ``comm``'s ranks into the mesh ``shape``. Collective: every rank calls it with
    the same shape (checked first: groups built from different shapes would hang)."""
    if shape.world_size != comm.world_size:
        raise ValueError(f"mesh dp {shape.dp} × pp {shape.pp} × tp {shape.tp} = "
                         f"{shape.world_size} ranks, but the communicator has "
                         f"{comm.world_size}; make the product equal the world size")
    check_agreement(comm, [shape.dp, shape.pp, shape.tp], "the mesh shape (dp, pp, tp)")
    subs: dict[str, Communicator | None] = {}
    for dim in ("tp", "pp", "dp"):  # the creation order every rank follows
        size = shape.size(dim)
        mine: Communicator | None = None
        if size == comm.world_size and size > 1:
            mine = comm
        elif size > 1:
            for members in shape.groups(dim):
                group = comm.new_group(list(members))
                mine = group if group is not None else mine
        subs[dim] = mine
    return DeviceMesh(shape, comm.rank, comm, subs["dp"], subs["pp"], subs["tp"])


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
