"""Key-range partitioning: every parameter element has a key; each server owns one range.

All trainable parameters, in ``named_parameters()`` order, are laid end to end in one flat
key space (the key of an element is its offset there). Server s owns the contiguous range
``[bounds[s], bounds[s+1])``; the ranges have equal sizes up to one row, because a cut is
snapped to the nearest row boundary (a row is ``tensor[i]``: an embedding row, a weight
matrix's output row, one element of a bias). A large tensor is therefore split across
servers, and a row always lives on one server, so sparse row updates never straddle two::

    keys  0 ─────────────────────────────────────────────────────────── total
          │ users.weight (rows …) │ items.weight (rows …) │ mlp.0.weight │ … │
    S = 2 │◄──────── server 0 ─────────────►│◄──────── server 1 ──────────────►│
                                  cut snapped to a row boundary of items.weight

Everything here is a pure function of the tensor shapes and the number of servers, so
servers and workers compute the same partition independently (the HELLO handshake compares
a fingerprint of it). ps-lite partitions keys into server ranges the same way (Li et al.,
OSDI 2014, §3.3; ps-lite uses consistent hashing to also move ranges, which we do not).
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


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
