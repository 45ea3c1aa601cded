"""Tensor plumbing shared by the stages: flat buffers whose views are the parameters.

Each stage keeps parameters as *views* into one padded flat buffer per group (the layout of
:mod:`~disttrain.parallel.zero.sharding`), so a collective moves a whole group in one call
and a rank's shard is a plain slice. A :class:`ShardGroup` is what checkpoints and memory
accounting see of a group: parameter names and shapes, the layout, and this rank's flat
"master" shard (the tensor the torch optimizer updates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from disttrain.parallel.zero.sharding import ShardLayout


@dataclass(frozen=True)
class ShardGroup:
    """One flat group: ``names[i]`` has ``shapes[i]``; ``master`` is this rank's shard (the
    optimizer's parameter, ``layout.shard_size`` elements, padding included)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    layout: ShardLayout
    master: torch.Tensor


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's parameters that require grad, each once (tied weights: first name)."""
    seen: set[int] = set()
    named = []
    for name, param in module.named_parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            named.append((name, param))
    if not named:
        raise ValueError("the model has no parameter with requires_grad=True: there is "
                         "nothing for ZeRO to shard or train")
    return named


def common_dtype(named: Sequence[tuple[str, torch.Tensor]]) -> torch.dtype:
    """The single dtype of all parameters (a flat buffer has one dtype)."""
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1:
        listing = ", ".join(sorted({f"{n}: {p.dtype}" for n, p in named})[:6])
        raise ValueError(f"ZeRO flattens parameters into one buffer, so they need one dtype; "
                         f"found {sorted(map(str, dtypes))} ({listing}); cast the model with "
                         f".to(dtype) first")
    return dtypes.pop()


def param_views(flat: torch.Tensor, params: Sequence[torch.Tensor],
                layout: ShardLayout) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``params`` (in layout order)."""
    return [flat[start:start + n].view(p.shape)
            for p, start, n in zip(params, layout.offsets(), layout.numels)]


def flatten_into_views(params: Sequence[torch.Tensor], layout: ShardLayout,
                       dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A zero-padded flat buffer holding the parameters' values, and its views; each
    parameter's ``.data`` becomes its view, so the module now reads the flat buffer."""
    device = params[0].device
    flat = torch.zeros(layout.padded_total, dtype=dtype, device=device)
    views = param_views(flat, params, layout)
    with torch.no_grad():
        for p, view in zip(params, views):
            view.copy_(p.detach())
            p.data = view
    return flat, views


def shard_of(flat: torch.Tensor, layout: ShardLayout, rank: int) -> torch.Tensor:
    """This rank's slice of a padded flat buffer (a view)."""
    start, end = layout.shard_range(rank)
    return flat[start:end]


def master_copy(shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The optimizer's parameter: the shard itself when dtypes match (no extra memory),
    else a copy in ``dtype`` (fp32 master weights for a bf16 model)."""
    if shard.dtype == dtype:
        return shard
    return shard.detach().to(dtype=dtype, copy=True)


def to_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` itself when it already has ``dtype``, else a cast copy."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
