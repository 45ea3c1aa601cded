"""Which rank owns which slice of the flattened parameters: pure shard maps, no tensors.

ZeRO (Rajbhandari et al. 2020) concatenates parameters into one flat vector of Ψ elements
and cuts it into ``world_size`` contiguous shards of equal length S = ⌈Ψ / N⌉. The last
shard is padded with zeros up to S so that every ``all_gather`` / ``reduce_scatter`` moves
equal blocks; the padding is never copied back into a parameter::

    params      [ w0 (6)      | b0 (2) | w1 (3)  ]         Ψ = 11, N = 3, S = 4
    flat        0 1 2 3 4 5 6 7 8 9 10 .                   (. = padding)
    rank 0      [0 1 2 3]              w0[0:4]
    rank 1      [4 5 6 7]              w0[4:6] b0[0:2]
    rank 2      [8 9 10 .]             w1[0:3] + 1 padding element

Each rank's shard is described by *pieces* (param index, offset in the param, offset in the
shard, length), which engines turn into tensor views. :func:`read_plan` maps the shards of
one layout onto those of another (a checkpoint saved on N ranks, loaded on M), and
:func:`partition` groups parameters into buckets: all pure data, tested without processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """``length`` elements of parameter ``param`` starting at ``param_offset`` (in the
    parameter's flattened order) live at ``shard_offset`` in the rank's shard."""

    param: int
    param_offset: int
    shard_offset: int
    length: int


@dataclass(frozen=True)
class ShardLayout:
    """The flat vector of ``numels`` cut into ``world_size`` shards of ``shard_size``."""

    numels: tuple[int, ...]
    world_size: int
    shard_size: int
    pieces: tuple[tuple[Piece, ...], ...]  # pieces[rank]

    @property
    def total(self) -> int:
        """Ψ: the number of real (unpadded) elements."""
        return sum(self.numels)

    @property
    def padded_total(self) -> int:
        """N × S: the length of the buffer that all_gather fills."""
        return self.shard_size * self.world_size

    @property
    def padding(self) -> int:
        return self.padded_total - self.total

    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat vector."""
        starts, acc = [], 0
        for n in self.numels:
            starts.append(acc)
            acc += n
        return tuple(starts)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The flat range ``[start, end)`` that ``rank`` owns, padding included."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def real_length(self, rank: int) -> int:
        """How many of the rank's S elements are real (the rest is padding)."""
        start, _ = self.shard_range(rank)
        return max(0, min(self.shard_size, self.total - start))


def shard_layout(numels: Sequence[int], world_size: int) -> ShardLayout:
    """Cut the concatenation of parameters with ``numels`` elements into ``world_size``
    equal contiguous shards (the last one padded)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    numels = tuple(numels)
    for i, n in enumerate(numels):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"numels[{i}] must be a non-negative int, got {n!r}")
    total = sum(numels)
    if total == 0:
        raise ValueError("there is nothing to shard: every parameter has 0 elements (does the "
                         "model have trainable parameters?)")
    size = -(-total // world_size)
    pieces: list[list[Piece]] = [[] for _ in range(world_size)]
    start = 0
    for index, n in enumerate(numels):
        done = 0
        while done < n:  # a parameter may span several shards
            flat = start + done
            rank, offset = divmod(flat, size)
            length = min(n - done, size - offset)
            pieces[rank].append(Piece(index, done, offset, length))
            done += length
        start += n
    return ShardLayout(numels, world_size, size, tuple(tuple(p) for p in pieces))


@dataclass(frozen=True)
class Read:
    """Copy ``length`` elements from ``src_offset`` of group ``src_group``'s shard on old
    rank ``src_rank`` to ``dst_offset`` of the new rank's shard."""

    src_group: int
    src_rank: int
    src_offset: int
    dst_offset: int
    length: int


def read_plan(
    sources: Sequence[ShardLayout],
    where: Sequence[tuple[int, int]],
    target: ShardLayout,
    rank: int,
) -> list[Read]:
    """How new ``rank`` of ``target`` fills its shard from the shards of an old layout.

    ``sources`` are the old layouts (one per flat group); ``where[i]`` = (old group, index
    in that group) of the target's parameter ``i``. Only the old ranks whose shards overlap
    the new shard are read, and adjacent reads are merged.
    """
    if len(where) != len(target.numels):
        raise ValueError(f"where has {len(where)} entries for {len(target.numels)} parameters")
    offsets = [layout.offsets() for layout in sources]
    reads: list[Read] = []
    for piece in target.pieces[rank]:
        group, index = where[piece.param]
        src = sources[group]
        if src.numels[index] != target.numels[piece.param]:
            raise ValueError(f"parameter {piece.param} has {target.numels[piece.param]} "
                             f"elements here but {src.numels[index]} in the source layout")
        flat = offsets[group][index] + piece.param_offset
        done = 0
        while done < piece.length:
            old_rank, old_offset = divmod(flat + done, src.shard_size)
            length = min(piece.length - done, src.shard_size - old_offset)
            _append(reads, Read(group, old_rank, old_offset, piece.shard_offset + done, length))
            done += length
    return reads


def _append(reads: list[Read], read: Read) -> None:
    """Append, merging with the previous read when both ends are contiguous."""
    if reads:
        last = reads[-1]
        if (last.src_group, last.src_rank) == (read.src_group, read.src_rank) and (
                last.src_offset + last.length == read.src_offset
                and last.dst_offset + last.length == read.dst_offset):
            reads[-1] = Read(last.src_group, last.src_rank, last.src_offset, last.dst_offset,
                             last.length + read.length)
            return
    reads.append(read)


def partition(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Group consecutive items (sizes in bytes) into buckets of about ``bucket_bytes``: a
    bucket closes once it reaches the limit, so one large item makes a bucket of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be ≥ 1, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(nbytes):
        current.append(i)
        size += n
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
