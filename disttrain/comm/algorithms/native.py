"""``native``: hand the whole collective to torch.distributed (Gloo's or NCCL's own kernels).

The baseline every disttrain algorithm is measured against, and the right choice at scale on
GPUs, where NCCL's kernels beat anything driven from Python. Bytes moved inside
torch.distributed are invisible to disttrain: they are recorded as unobserved.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from disttrain.comm.context import CollectiveContext
from disttrain.comm.ops import ReduceOp, to_torch
from disttrain.comm.transports.torch_p2p import translate_error


def _wait(ctx: CollectiveContext, work: Any) -> None:
    if work is None:
        return
    try:
        work.wait(timeout=datetime.timedelta(seconds=ctx.timeout_s))
    except RuntimeError as exc:
        err = translate_error(exc)
        if isinstance(err, (TimeoutError, ConnectionError)):  # torch does not say who failed
            raise ctx.failure("inside torch.distributed", exc, None,
                              timed_out=isinstance(err, TimeoutError)) from exc
        raise


def _group(ctx: CollectiveContext) -> Any:
    group = ctx.native_group
    if group is None:
        raise ValueError(
            f"algorithm='native' needs a torch.distributed transport; transport "
            f"{ctx.transport.name!r} has none. Pick another algorithm."
        )
    return group


# torch 2.13 renamed the flat-buffer collectives (the old names warn on every call).
_ALL_GATHER: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER: Any = (getattr(dist, "reduce_scatter_single", None)
                        or dist.reduce_scatter_tensor)


def _global(ctx: CollectiveContext, rank: int) -> int:
    return ctx.transport.global_ranks[rank]


def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, op: ReduceOp) -> None:
    _wait(ctx, dist.all_reduce(tensor, to_torch(op), group=_group(ctx), async_op=True))


def broadcast(ctx: CollectiveContext, tensor: torch.Tensor, root: int) -> None:
    _wait(ctx, dist.broadcast(tensor, _global(ctx, root), group=_group(ctx), async_op=True))


def reduce(ctx: CollectiveContext, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
    work = dist.reduce(tensor, _global(ctx, root), to_torch(op), group=_group(ctx), async_op=True)
    _wait(ctx, work)


def gather(
    ctx: CollectiveContext, output: torch.Tensor | None, tensor: torch.Tensor, root: int
) -> None:
    blocks = list(output.chunk(ctx.world_size)) if output is not None else None
    if blocks is not None and tensor.numel() == 0:
        blocks = [output.new_empty(0) for _ in range(ctx.world_size)]  # type: ignore[union-attr]
    work = dist.gather(tensor, blocks, _global(ctx, root), group=_group(ctx), async_op=True)
    _wait(ctx, work)


def scatter(
    ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor | None, root: int
) -> None:
    n = output.numel()
    blocks = ([tensor[i * n : (i + 1) * n] for i in range(ctx.world_size)]
              if tensor is not None else None)
    work = dist.scatter(output, blocks, _global(ctx, root), group=_group(ctx), async_op=True)
    _wait(ctx, work)


def all_gather(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor) -> None:
    work = _ALL_GATHER(output, tensor, group=_group(ctx), async_op=True)
    _wait(ctx, work)


def reduce_scatter(
    ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
) -> None:
    work = _REDUCE_SCATTER(output, tensor, to_torch(op), group=_group(ctx), async_op=True)
    _wait(ctx, work)


def all_to_all(
    ctx: CollectiveContext,
    output: torch.Tensor,
    tensor: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
) -> None:
    work = dist.all_to_all_single(output, tensor, out_splits, in_splits, group=_group(ctx),
                                  async_op=True)
    _wait(ctx, work)


def barrier(ctx: CollectiveContext) -> None:
    _wait(ctx, dist.barrier(group=_group(ctx), async_op=True))
