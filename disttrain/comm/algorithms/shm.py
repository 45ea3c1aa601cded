"""``shm``: whole collectives in shared memory, for the ``shm`` transport only.

Instead of messages, ranks copy into their slot of the segment's collective area, meet at a
counter barrier, and read each other's slots directly (``transports/shm_collectives.py``).
Large tensors stream through the fixed-size slots in rounds: per round, every rank writes
its part, one barrier, every rank reads what it needs. all_reduce, the one that matters
most, has its own module (``shm_all_reduce.py``); shared pieces are in ``shm_base.py``.

Reductions always run in rank order, so every rank gets bit-identical results that equal
the single-process reference ``((x0 ⊕ x1) ⊕ x2) …``. Bytes written into the segment count as
sent, bytes read from other ranks' slots as received.
"""

from __future__ import annotations

import torch

from disttrain.comm.algorithms.chunking import sub_chunks
from disttrain.comm.algorithms.shm_all_reduce import all_reduce
from disttrain.comm.algorithms.shm_base import (
    area_of,
    count,
    per_round,
    reduce_into,
    step,
    supports,
)
from disttrain.comm.context import CollectiveContext
from disttrain.comm.ops import ReduceOp
from disttrain.comm.transports.shm_collectives import CollectiveArea

__all__ = ["all_gather", "all_reduce", "all_to_all", "barrier", "broadcast", "gather", "reduce",
           "reduce_scatter", "scatter", "supports"]


# ---------------------------------------------------------------------------- the others
def reduce_scatter(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor,
                   op: ReduceOp) -> None:
    area = area_of(ctx)
    p, me, n = ctx.world_size, ctx.rank, output.numel()
    if p == 1:
        output.copy_(tensor)
        return
    blocks = tensor.view(p, n)
    for a, b in sub_chunks(0, n, per_round(area, tensor, p)):
        m = b - a
        slots = area.slots(area.begin_round(), tensor.dtype)
        slots[me][: p * m].view(p, m).copy_(blocks[:, a:b])  # block j → slot[me][j·m …]
        step(ctx, area)
        reduce_into(output[a:b], [slots[r][me * m : (me + 1) * m] for r in range(p)], op)
        count(ctx, p * m * tensor.element_size(), (p - 1) * m * tensor.element_size())


def all_gather(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor) -> None:
    area = area_of(ctx)
    p, me, n = ctx.world_size, ctx.rank, tensor.numel()
    out = output.view(p, n)
    for a, b in sub_chunks(0, n, per_round(area, tensor)):
        m, s = b - a, area.begin_round()
        area.slots(s, tensor.dtype)[me][:m].copy_(tensor[a:b])
        step(ctx, area)
        out[:, a:b].copy_(area.region(s, tensor.dtype).view(p, -1)[:, :m])
        count(ctx, m * tensor.element_size(), (p - 1) * m * tensor.element_size())


def broadcast(ctx: CollectiveContext, tensor: torch.Tensor, root: int) -> None:
    area = area_of(ctx)
    if ctx.world_size == 1:
        return
    for a, b in sub_chunks(0, tensor.numel(), per_round(area, tensor) * ctx.world_size):
        region = area.region(area.begin_round(), tensor.dtype)  # the root fills all p slots
        nbytes = (b - a) * tensor.element_size()
        if ctx.rank == root:
            region[: b - a].copy_(tensor[a:b])
        step(ctx, area)
        if ctx.rank != root:
            tensor[a:b].copy_(region[: b - a])
        count(ctx, nbytes if ctx.rank == root else 0, 0 if ctx.rank == root else nbytes)


def reduce(ctx: CollectiveContext, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
    area = area_of(ctx)
    p, me = ctx.world_size, ctx.rank
    if p == 1:
        return
    for a, b in sub_chunks(0, tensor.numel(), per_round(area, tensor)):
        m = b - a
        slots = area.slots(area.begin_round(), tensor.dtype)
        slots[me][:m].copy_(tensor[a:b])
        step(ctx, area)
        if me == root:
            reduce_into(tensor[a:b], [slots[r][:m] for r in range(p)], op)
        nbytes = m * tensor.element_size()
        count(ctx, nbytes, (p - 1) * nbytes if me == root else 0)


def gather(ctx: CollectiveContext, output: torch.Tensor | None, tensor: torch.Tensor,
           root: int) -> None:
    area = area_of(ctx)
    p, me, n = ctx.world_size, ctx.rank, tensor.numel()
    for a, b in sub_chunks(0, n, per_round(area, tensor)):
        m, s = b - a, area.begin_round()
        area.slots(s, tensor.dtype)[me][:m].copy_(tensor[a:b])
        step(ctx, area)
        if output is not None:
            output.view(p, n)[:, a:b].copy_(area.region(s, tensor.dtype).view(p, -1)[:, :m])
        nbytes = m * tensor.element_size()
        count(ctx, nbytes, (p - 1) * nbytes if me == root else 0)


def scatter(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor | None,
            root: int) -> None:
    area = area_of(ctx)
    p, me, n = ctx.world_size, ctx.rank, output.numel()
    for a, b in sub_chunks(0, n, per_round(area, output)):
        m, s = b - a, area.begin_round()
        if tensor is not None:  # the root writes block j into slot j
            area.region(s, output.dtype).view(p, -1)[:, :m].copy_(tensor.view(p, n)[:, a:b])
        step(ctx, area)
        output[a:b].copy_(area.slots(s, output.dtype)[me][:m])
        nbytes = m * output.element_size()
        count(ctx, (p - 1) * nbytes if me == root else 0, 0 if me == root else nbytes)


def barrier(ctx: CollectiveContext) -> None:
    step(ctx, area_of(ctx))


def all_to_all(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor,
               out_splits: list[int], in_splits: list[int]) -> None:
    """Slot of rank r = [r's send and receive splits | sub-slot for rank 0 | … | for p−1];
    rank d reads sub-slot d of every slot. Splits travel in round 0, so every rank knows
    how many rounds the largest block needs (and every rank sees a split mismatch)."""
    area = area_of(ctx)
    p, me, es = ctx.world_size, ctx.rank, tensor.element_size()
    meta = -(-16 * p // 64) * 64
    sub = (area.slot_bytes - meta) // p // 64 * 64  # bytes per destination per round
    per = sub // es
    in_off = [sum(in_splits[:j]) for j in range(p)]
    out_off = [sum(out_splits[:j]) for j in range(p)]
    output[out_off[me] : out_off[me] + out_splits[me]].copy_(
        tensor[in_off[me] : in_off[me] + in_splits[me]])
    rounds, k = 1, 0
    while k < rounds:
        s = area.begin_round()
        slots, sent, received = area.slots(s, tensor.dtype), 0, 0
        if k == 0:
            area.slots(s, torch.int64)[me][: 2 * p].copy_(torch.tensor(in_splits + out_splits))
        for d in range(p):
            lo, hi = k * per, min((k + 1) * per, in_splits[d])
            if d != me and hi > lo:
                at = (meta + d * sub) // es
                slots[me][at : at + hi - lo].copy_(tensor[in_off[d] + lo : in_off[d] + hi])
                sent += (hi - lo) * es
        step(ctx, area)
        if k == 0:
            rounds = _rounds_for_splits(area, s, p, per)
        for r in range(p):
            lo, hi = k * per, min((k + 1) * per, out_splits[r])
            if r != me and hi > lo:
                at = (meta + me * sub) // es
                output[out_off[r] + lo : out_off[r] + hi].copy_(slots[r][at : at + hi - lo])
                received += (hi - lo) * es
        count(ctx, sent, received)
        k += 1


def _rounds_for_splits(area: CollectiveArea, buffer_set: int, p: int, per: int) -> int:
    """Read every rank's splits from round 0 and check that senders and receivers agree."""
    table = [[int(v) for v in slot[: 2 * p]] for slot in area.slots(buffer_set, torch.int64)]
    for r in range(p):
        for d in range(p):
            if table[r][d] != table[d][p + r]:
                raise ValueError(
                    f"all_to_all: rank {r} sends {table[r][d]} elements to rank {d}, which "
                    f"expects {table[d][p + r]}; input_split_sizes on each rank must match "
                    "the output_split_sizes of its peers")
    return max(1, *(-(-table[r][d] // per) for r in range(p) for d in range(p)))
