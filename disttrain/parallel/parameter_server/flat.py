"""Copy between a model's parameter tensors and flat key ranges of the partition."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from disttrain.parallel.parameter_server.partition import Partition


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
