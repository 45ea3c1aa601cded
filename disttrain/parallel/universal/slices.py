"""Which part of a model's tensor a rank holds, and where in its own memory: pure shard maps.

Every strategy holds each tensor of the model (a parameter, a buffer, an optimizer moment)
whole, or a part of it, and a universal checkpoint names every part by the *global*
tensor's name and a rectangular :class:`Box` of it (offsets and sizes per dimension, as
torch.distributed.checkpoint's chunks do). Two ways of cutting compose into such boxes::

    tensor parallelism cuts dims          ZeRO cuts the flat (row-major) order of a tensor
    ┌──────┬──────┐ global (4, 6)          local (4, 3), elements 5..10 of its 12:
    │ tp 0 │ tp 1 │ "cols": rank 1 holds   ┌───┐   row 1, cols 2..3   box (1, 2)+(1, 1)
    │      │      │ box (0, 3)+(4, 3)      │  ▓│   rows 2..3, all     box (2, 0)+(1, 3)
    │      │      │                        │▓▓▓│   row 3, cols 0..1   box (3, 0)+(1, 2)
    └──────┴──────┘                        │▓▓ │   (each box contiguous in the flat order)
                                           └───┘

A rank's local tensor is laid out by a :class:`Placement`: its pieces map boxes of the
local tensor onto boxes of the global one (one piece for a plain split, three for a fused
QKV weight split head-wise: the rows of Q, K and V each). :func:`regions` turns "elements
``start..stop`` of the local tensor, stored flat from ``base``" into :class:`Region` s:
global boxes with the strides and offset that view them in the flat storage
(``as_strided``), which is all a writer or a reader needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Shape = tuple[int, ...]


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def row_major_strides(shape: Sequence[int]) -> Shape:
    """Element strides of a contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Box:
    """The block ``[offsets, offsets + sizes)`` of a tensor, one range per dimension."""

    offsets: Shape
    sizes: Shape

    @property
    def numel(self) -> int:
        return numel(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common block, or None when they share no element."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes,
                                                             other.offsets, other.sizes))
        if any(h <= start for start, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - start for start, h in zip(lo, hi)))

    def shifted(self, by: Sequence[int]) -> Box:
        return Box(tuple(o + d for o, d in zip(self.offsets, by)), self.sizes)

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this block inside a tensor holding block ``outer``."""
        return tuple(slice(o - p, o - p + s)
                     for o, s, p in zip(self.offsets, self.sizes, outer.offsets))


def whole(shape: Sequence[int]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(shape))


@dataclass(frozen=True)
class Piece:
    """Block ``local`` of the local tensor is the block at ``origin`` of the global one."""

    local: Box
    origin: Shape

    def to_global(self, box: Box) -> Box:
        return box.shifted(tuple(g - s for g, s in zip(self.origin, self.local.offsets)))


@dataclass(frozen=True)
class Placement:
    """How a local tensor of ``local_shape`` sits in the global tensor of ``shape``."""

    shape: Shape
    local_shape: Shape
    pieces: tuple[Piece, ...]


def replicated(shape: Sequence[int]) -> Placement:
    """The whole tensor, held whole (DDP's replicas, a pipeline stage's own layers)."""
    shape = tuple(shape)
    return Placement(shape, shape, (Piece(whole(shape), tuple(0 for _ in shape)),))


def split(local_shape: Sequence[int], dim: int, parts: int, rank: int, size: int
          ) -> Placement:
    """Rank ``rank`` of ``size`` holds, along ``dim``, the ``rank``-th of ``size`` equal
    slices of each of ``parts`` equal parts (tensor parallelism's ``"rows"``, ``"cols"``,
    ``"rows/3"``: :func:`disttrain.parallel.tensor.layers.shard`)."""
    local = tuple(local_shape)
    if local[dim] % parts:
        raise ValueError(f"a local tensor of {local} does not split into {parts} parts along "
                         f"dim {dim}")
    shape = (*local[:dim], local[dim] * size, *local[dim + 1:])
    step = local[dim] // parts  # this rank's rows of each part
    pieces = []
    for p in range(parts):
        sizes = (*local[:dim], step, *local[dim + 1:])
        start = tuple(p * step if d == dim else 0 for d in range(len(local)))
        origin = tuple(p * step * size + rank * step if d == dim else 0
                       for d in range(len(local)))
        pieces.append(Piece(Box(start, sizes), origin))
    return Placement(shape, local, tuple(pieces))


@dataclass(frozen=True)
class Split:
    """How tensor parallelism cut one parameter: :func:`split`'s arguments but the shape."""

    dim: int
    parts: int
    rank: int
    size: int

    def placement(self, local_shape: Sequence[int]) -> Placement:
        return split(local_shape, self.dim, self.parts, self.rank, self.size)


@dataclass(frozen=True)
class Region:
    """Global block ``box`` lives in a flat storage at ``offset`` with ``strides``."""

    box: Box
    offset: int
    strides: Shape

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The block's elements in ``flat`` (1-D, contiguous), as a view."""
        return flat.as_strided(self.box.sizes, self.strides, flat.storage_offset() + self.offset)


def contiguous_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[int, Box]]:
    """Elements ``start..stop`` (row-major) of a tensor of ``shape`` as blocks, each
    contiguous in that order (a partial first row, whole rows, a partial last row, and so
    on down the dimensions): ``(flat index of its first element, block)``."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [(0, Box((), ()))]
    strides = row_major_strides(shape)
    out: list[tuple[int, Box]] = []

    def cover(prefix: Shape, dim: int, lo: int, hi: int) -> None:
        # elements lo..hi of the sub-tensor at ``prefix`` (its dims are dim..)
        ones = tuple(1 for _ in prefix)
        if dim == len(shape) - 1:  # a run along the last dim
            offsets = (*prefix, lo)
            out.append((_flat(offsets, strides), Box(offsets, (*ones, hi - lo))))
            return
        inner = strides[dim]  # elements per index of this dim
        first, last = -(-lo // inner), hi // inner  # whole indices first..last-1
        if first > last:  # inside one index: go down
            i = lo // inner
            cover((*prefix, i), dim + 1, lo - i * inner, hi - i * inner)
            return
        if lo < first * inner:  # the partial head
            cover((*prefix, first - 1), dim + 1, lo - (first - 1) * inner, inner)
        if first < last:
            tail = shape[dim + 1:]
            offsets = (*prefix, first, *tuple(0 for _ in tail))
            out.append((_flat(offsets, strides), Box(offsets, (*ones, last - first, *tail))))
        if last * inner < hi:  # the partial tail
            cover((*prefix, last), dim + 1, 0, hi - last * inner)

    cover((), 0, start, stop)
    return out


def _flat(index: Sequence[int], strides: Sequence[int]) -> int:
    return sum(i * s for i, s in zip(index, strides))


def regions(placement: Placement, start: int = 0, stop: int | None = None,
            base: int = 0) -> list[Region]:
    """Where this rank's elements ``start..stop`` of its local tensor (stored flat from
    ``base``, in row-major order) lie in the global tensor: one region per contiguous block
    and piece."""
    local = placement.local_shape
    stop = numel(local) if stop is None else stop
    strides = row_major_strides(local)
    found: list[Region] = []
    for _, block in contiguous_boxes(local, start, stop):
        for piece in placement.pieces:
            common = block.intersect(piece.local)
            if common is None:
                continue
            found.append(Region(piece.to_global(common), base + _flat(common.offsets, strides)
                                - start, strides))
    return found


def holds_first(found: Sequence[Region]) -> bool:
    """Whether ``found`` includes the global tensor's first element (who writes a scalar
    that every holder of a part keeps, such as Adam's step)."""
    return any(all(o == 0 for o in r.box.offsets) for r in found)
