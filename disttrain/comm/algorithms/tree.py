"""Binomial-tree algorithms: ⌈log₂ p⌉ rounds, latency-optimal for small messages.

In round k every rank that already has the data sends it 2^k ranks further, so the set of
informed ranks doubles each round (ranks are counted relative to the root)::

    round 0:  0 ─▶ 1
    round 1:  0 ─▶ 2    1 ─▶ 3
    round 2:  0 ─▶ 4    1 ─▶ 5    2 ─▶ 6    3 ─▶ 7

Reduce and gather run the same tree upwards; scatter runs it downwards carrying the blocks
of each subtree. All-reduce is a reduce to rank 0 followed by a broadcast from it.
"""

from __future__ import annotations

import torch

from disttrain.comm.context import CollectiveContext
from disttrain.comm.ops import ReduceOp, combine_


def _rel(ctx: CollectiveContext, root: int) -> int:
    return (ctx.rank - root) % ctx.world_size


def _real(vr: int, root: int, p: int) -> int:
    return (vr + root) % p


def broadcast(ctx: CollectiveContext, tensor: torch.Tensor, root: int) -> None:
    p, vr = ctx.world_size, _rel(ctx, root)
    mask = 1
    while mask < p:
        if vr & mask:
            ctx.recv(tensor, _real(vr - mask, root, p))
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if vr + mask < p:
            sends.append(ctx.isend(tensor, _real(vr + mask, root, p)))
        mask >>= 1
    ctx.wait_all(sends)


def reduce(ctx: CollectiveContext, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
    """Result on ``root``; on other ranks ``tensor`` holds a partial sum afterwards."""
    p, vr = ctx.world_size, _rel(ctx, root)
    tmp = ctx.scratch_like(tensor)
    mask = 1
    while mask < p:
        if vr & mask:
            ctx.send(tensor, _real(vr - mask, root, p))
            return
        if vr + mask < p:
            ctx.recv(tmp, _real(vr + mask, root, p))
            combine_(tensor, tmp, op)
        mask <<= 1


def gather(
    ctx: CollectiveContext, output: torch.Tensor | None, tensor: torch.Tensor, root: int
) -> None:
    """Each node collects its subtree's blocks (contiguous in relative-rank order)."""
    p, vr, n = ctx.world_size, _rel(ctx, root), tensor.numel()
    span = 1  # relative ranks [vr, vr + span) are held in ``held``
    held = ctx.scratch(_subtree_size(vr, p) * n, tensor)
    held[:n].copy_(tensor)
    mask = 1
    while mask < p:
        if vr & mask:
            ctx.send(held[: span * n], _real(vr - mask, root, p))
            return
        if vr + mask < p:
            count = min(mask, p - vr - mask)
            ctx.recv(held[span * n : (span + count) * n], _real(vr + mask, root, p))
            span += count
        mask <<= 1
    assert output is not None  # only the root gets here
    for rel in range(p):  # relative order → rank order
        real = _real(rel, root, p)
        output[real * n : (real + 1) * n].copy_(held[rel * n : (rel + 1) * n])


def scatter(
    ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor | None, root: int
) -> None:
    p, vr, n = ctx.world_size, _rel(ctx, root), output.numel()
    size = _subtree_size(vr, p)
    held = ctx.scratch(size * n, output)  # blocks of relative ranks [vr, vr + size)
    mask = 1
    while mask < p:
        if vr & mask:
            ctx.recv(held, _real(vr - mask, root, p))
            break
        mask <<= 1
    else:
        assert tensor is not None  # the root: arrange its input in relative order
        for rel in range(p):
            real = _real(rel, root, p)
            held[rel * n : (rel + 1) * n].copy_(tensor[real * n : (real + 1) * n])
    mask >>= 1
    sends = []
    while mask > 0:
        if vr + mask < p:
            child_size = _subtree_size(vr + mask, p)
            block = held[mask * n : (mask + child_size) * n]
            sends.append(ctx.isend(block, _real(vr + mask, root, p)))
        mask >>= 1
    ctx.wait_all(sends)
    output.copy_(held[:n])


def _subtree_size(vr: int, p: int) -> int:
    """How many relative ranks the binomial subtree rooted at ``vr`` spans."""
    if vr == 0:
        return p
    lowest = vr & -vr
    return min(lowest, p - vr)


def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, op: ReduceOp) -> None:
    reduce(ctx, tensor, 0, op)
    broadcast(ctx, tensor, 0)


def barrier(ctx: CollectiveContext) -> None:
    token = torch.zeros(1, dtype=torch.uint8, device=ctx.transport.device_type)
    reduce(ctx, token, 0, ReduceOp.MAX)
    broadcast(ctx, token, 0)
