"""Naive (direct) algorithms: every rank talks to every other rank directly.

The baseline of the ring all-reduce analysis (Patarasuk & Yuan 2009; Gibiansky 2017):
for all-reduce each of the p ranks sends its whole vector V to the p−1 others, p(p−1)V
bytes in total, (p−1)V per rank, against the ring's 2(p−1)V/p per rank::

    r0 ──V──▶ r1, r2, r3      every rank: p−1 sends of V, p−1 receives of V,
    r1 ──V──▶ r0, r2, r3      then reduces the p vectors in rank order (0, 1, …, p−1)
    …                          so every rank computes the identical result

One step, so it can win for tiny messages where latency (α) dominates. Each pair posts its
two messages lower rank first (``CollectiveContext.exchange``), the order NCCL needs.
"""

from __future__ import annotations

import torch

from disttrain.comm.context import CollectiveContext, Pending
from disttrain.comm.ops import ReduceOp, combine_


def _reduce_in_rank_order(out: torch.Tensor, parts: list[torch.Tensor], op: ReduceOp) -> None:
    out.copy_(parts[0])
    for part in parts[1:]:
        combine_(out, part, op)


def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, op: ReduceOp) -> None:
    p, me = ctx.world_size, ctx.rank
    if p == 1:
        return
    bufs = {peer: ctx.scratch_like(tensor) for peer in range(p) if peer != me}
    ctx.wait_all([q for peer in bufs for q in ctx.exchange(tensor, bufs[peer], peer)])
    mine = ctx.scratch_copy(tensor)
    _reduce_in_rank_order(tensor, [mine if r == me else bufs[r] for r in range(p)], op)


def broadcast(ctx: CollectiveContext, tensor: torch.Tensor, root: int) -> None:
    if ctx.rank == root:
        ctx.wait_all([ctx.isend(tensor, peer) for peer in range(ctx.world_size) if peer != root])
    else:
        ctx.recv(tensor, root)


def reduce(ctx: CollectiveContext, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
    p, me = ctx.world_size, ctx.rank
    if me != root:
        ctx.send(tensor, root)
        return
    bufs = {peer: ctx.scratch_like(tensor) for peer in range(p) if peer != me}
    ctx.wait_all([ctx.irecv(bufs[peer], peer) for peer in bufs])
    mine = ctx.scratch_copy(tensor)
    _reduce_in_rank_order(tensor, [mine if r == me else bufs[r] for r in range(p)], op)


def gather(
    ctx: CollectiveContext, output: torch.Tensor | None, tensor: torch.Tensor, root: int
) -> None:
    n = tensor.numel()
    if ctx.rank != root:
        ctx.send(tensor, root)
        return
    assert output is not None
    pending = []
    for peer in range(ctx.world_size):
        block = output[peer * n : (peer + 1) * n]
        if peer == root:
            block.copy_(tensor)
        else:
            pending.append(ctx.irecv(block, peer))
    ctx.wait_all(pending)


def scatter(
    ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor | None, root: int
) -> None:
    n = output.numel()
    if ctx.rank != root:
        ctx.recv(output, root)
        return
    assert tensor is not None
    pending = []
    for peer in range(ctx.world_size):
        block = tensor[peer * n : (peer + 1) * n]
        if peer == root:
            output.copy_(block)
        else:
            pending.append(ctx.isend(block, peer))
    ctx.wait_all(pending)


def all_gather(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor) -> None:
    p, me, n = ctx.world_size, ctx.rank, tensor.numel()
    output[me * n : (me + 1) * n].copy_(tensor)
    ctx.wait_all([q for r in range(p) if r != me
                  for q in ctx.exchange(tensor, output[r * n : (r + 1) * n], r)])


def reduce_scatter(
    ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
) -> None:
    p, me, n = ctx.world_size, ctx.rank, output.numel()
    bufs = {peer: ctx.scratch_like(output) for peer in range(p) if peer != me}
    ctx.wait_all([q for r in bufs
                  for q in ctx.exchange(tensor[r * n : (r + 1) * n], bufs[r], r)])
    mine = tensor[me * n : (me + 1) * n]
    _reduce_in_rank_order(output, [mine if r == me else bufs[r] for r in range(p)], op)


def all_to_all(
    ctx: CollectiveContext,
    output: torch.Tensor,
    tensor: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
) -> None:
    """Pairwise exchange: rank r sends block j of its input to rank j (p−1 partners)."""
    p, me = ctx.world_size, ctx.rank
    in_offsets = [sum(in_splits[:j]) for j in range(p)]
    out_offsets = [sum(out_splits[:j]) for j in range(p)]
    out_blocks = [output[out_offsets[j] : out_offsets[j] + out_splits[j]] for j in range(p)]
    in_blocks = [tensor[in_offsets[j] : in_offsets[j] + in_splits[j]] for j in range(p)]
    out_blocks[me].copy_(in_blocks[me])
    pending: list[Pending] = []
    for shift in range(1, p):  # staggered partners so no rank is flooded first
        src, dst = (me - shift) % p, (me + shift) % p
        if src == dst:  # the partner opposite (even p): both directions on one pair
            pending += ctx.exchange(in_blocks[dst], out_blocks[src], dst)
        else:  # the pair (me, src) sees these in the order (src, me) posts them too
            pending += [ctx.irecv(out_blocks[src], src), ctx.isend(in_blocks[dst], dst)]
    ctx.wait_all(pending)


def barrier(ctx: CollectiveContext) -> None:
    """Everyone tells rank 0, rank 0 tells everyone: 2(p−1) one-byte messages."""
    device = ctx.transport.device_type
    token = torch.zeros(1, dtype=torch.uint8, device=device)
    if ctx.rank == 0:
        peers = range(1, ctx.world_size)
        ctx.wait_all([ctx.irecv(torch.empty(1, dtype=torch.uint8, device=device), r, step=0)
                      for r in peers])
        ctx.wait_all([ctx.isend(token, r, step=1) for r in peers])
    else:
        ctx.send(token, 0, step=0)
        ctx.recv(torch.empty(1, dtype=torch.uint8, device=device), 0, step=1)

