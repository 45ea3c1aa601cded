"""Make replicas start identical: check every rank built the same model, then copy rank 0's.

The check all-gathers a small fingerprint per tensor (name hash, dtype, shape) instead of the
tensors themselves, so it costs a few hundred bytes. Every rank sees every fingerprint, so a
mismatch is found, and reported, on *every* rank, naming the first tensor that differs and
what each rank holds there::

    ValueError: DataParallel: parameter #4 differs across ranks: rank 0 has 'fc.weight'
    (10, 84) torch.float32; rank 1 has 'fc.weight' (12, 84) torch.float32. ...
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from disttrain.comm import Communicator

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128]
_MAX_DIMS = 4  # dims spelled out in the fingerprint (more are covered by numel)
_WIDTH = 4 + _MAX_DIMS
_NAME_BYTES = 200


def fingerprint(name: str, tensor: torch.Tensor) -> list[int]:
    """``[crc32(name), dtype code, ndim, numel, d0..d3]`` as ints (-1 pads missing dims)."""
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    dims = list(tensor.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(tensor.dim(), _MAX_DIMS))
    return [zlib.crc32(name.encode()), code, tensor.dim(), tensor.numel(), *dims]


def describe(row: Sequence[int]) -> str:
    """``(10, 84) torch.float32`` from a fingerprint row."""
    code, ndim, numel = row[1], row[2], row[3]
    dtype = str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "another dtype"
    if ndim <= _MAX_DIMS:
        return f"{tuple(row[4 : 4 + ndim])} {dtype}"
    return f"{ndim}-d with {numel} elements {dtype}"


def check_same_tensors(comm: Communicator, named: Sequence[tuple[str, torch.Tensor]],
                       what: str = "parameter") -> None:
    """Raise ValueError on every rank unless all ranks hold the same names, shapes, dtypes."""
    p = comm.world_size
    counts = torch.zeros(p, dtype=torch.int64)
    comm.all_gather(counts, torch.tensor([len(named)], dtype=torch.int64))
    longest = int(counts.max())
    rows = torch.full((longest, _WIDTH), -1, dtype=torch.int64)
    for i, (name, tensor) in enumerate(named):
        rows[i] = torch.tensor(fingerprint(name, tensor))
    everyone = torch.empty(p, longest, _WIDTH, dtype=torch.int64)
    comm.all_gather(everyone, rows)
    differs = (everyone != everyone[0]).any(dim=2).any(dim=0).nonzero()
    if differs.numel() == 0:
        return
    first = int(differs[0])
    names = _gather_names(comm, named[first][0] if first < len(named) else "")
    held = []
    for rank in range(p):
        if first >= int(counts[rank]):
            held.append(f"rank {rank} has no {what} #{first} (it has {int(counts[rank])})")
        else:
            row = everyone[rank, first].tolist()
            held.append(f"rank {rank} has {names[rank]!r} {describe(row)}")
    raise ValueError(
        f"DataParallel: {what} #{first} differs across ranks: {'; '.join(held)}. Every rank "
        f"must build the same model (same code, same constructor arguments) before wrapping it")


def _gather_names(comm: Communicator, name: str) -> list[str]:
    """Every rank's ``name`` (UTF-8, truncated to a fixed width), in rank order."""
    raw = name.encode()[:_NAME_BYTES]
    mine = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    everyone = torch.empty(comm.world_size, _NAME_BYTES, dtype=torch.uint8)
    comm.all_gather(everyone, mine)
    return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in everyone]


def broadcast_tensors(comm: Communicator, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
    """Overwrite ``tensors`` with ``root``'s values: one broadcast per (dtype, device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for members in groups.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            comm.broadcast(flat, root)
            offset = 0
            for t in members:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

