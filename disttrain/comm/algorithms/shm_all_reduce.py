"""``shm`` all-reduce: one-shot for small tensors, reduce-scatter + all-gather for large.

::

    one-shot (≤ one_shot_max_bytes)       reduce-scatter + all-gather (larger), per round:
    r: copy x → slot[r]                   r: copy chunk (all but seg_r) → slot[r]
    ── barrier ──                         ── barrier ──
    r: x = slot[0] ⊕ … ⊕ slot[p−1]        r: acc = x0[seg_r] ⊕ … ⊕ x(p−1)[seg_r]
       (every rank, identical order)         published in slot[r][seg_r]
                                          ── barrier ──
                                          r: copy slot[i][seg_i] → chunk[seg_i], i ≠ r

The one-shot path is what small all-reduces (most of data-parallel training of small and
medium models) cost, so it does the least: slot views cut to this size are cached by the
area, one copy in, one barrier, p−1 kernel calls straight into the user's tensor, one
counter update. Large rounds are bound by memory traffic: two-operand in-place kernels
(``acc ⊕= part``) move a third less than three-operand ones, so ranks 0 and 1 accumulate
in their own segment of ``x`` (rank 1 starts from ``x1 ⊕ x0``, the same bits as ``x0 ⊕ x1``
for +, ×) and copy the result into the slot; ranks ≥ 2 accumulate in their slot, which they
then copy back. Either way rank order is kept, so results equal ``((x0 ⊕ x1) ⊕ x2) …``.
"""

from __future__ import annotations

import torch

from disttrain.comm.algorithms.chunking import segment_bounds, sub_chunks
from disttrain.comm.algorithms.shm_base import (
    COMMUTATIVE,
    KERNELS,
    area_of,
    count,
    per_round,
    reduce_into,
    step,
)
from disttrain.comm.context import CollectiveContext
from disttrain.comm.ops import ReduceOp
from disttrain.comm.transports.shm_collectives import CollectiveArea


def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, op: ReduceOp) -> None:
    area = area_of(ctx)
    if ctx.world_size == 1 or tensor.numel() == 0:
        return
    if tensor.numel() * tensor.element_size() <= area.one_shot_max_bytes:
        _one_shot(ctx, area, tensor, op)
    else:
        for a, b in sub_chunks(0, tensor.numel(), per_round(area, tensor)):
            _two_phase(ctx, area, tensor[a:b], op)


def _one_shot(ctx: CollectiveContext, area: CollectiveArea, x: torch.Tensor,
              op: ReduceOp) -> None:
    n, p = x.numel(), ctx.world_size
    slots = area.heads(area.begin_round(), x.dtype, n)
    slots[ctx.rank].copy_(x)
    step(ctx, area)
    reduce_into(x, slots, op)
    nbytes = n * x.element_size()
    ctx.stats.count(ctx.op, nbytes, (p - 1) * nbytes)


def _two_phase(ctx: CollectiveContext, area: CollectiveArea, chunk: torch.Tensor,
               op: ReduceOp) -> None:
    """One round of reduce-scatter + all-gather over ``chunk`` (≤ one slot). Rank r never
    needs its own segment in shared memory as an input, so it copies in only the others'."""
    p, me, m = ctx.world_size, ctx.rank, chunk.numel()
    slots = area.slots(area.begin_round(), chunk.dtype)
    bounds = segment_bounds(m, p)
    s0, s1 = bounds[me]
    slots[me][:s0].copy_(chunk[:s0])
    slots[me][s1:m].copy_(chunk[s1:])
    step(ctx, area)
    in_place = s1 > s0 and _accumulate(chunk[s0:s1], slots, s0, s1, me, op)
    if in_place:
        slots[me][s0:s1].copy_(chunk[s0:s1])  # publish the reduced segment
    step(ctx, area)
    for r in range(p):
        r0, r1 = bounds[r]
        if r1 > r0 and (r != me or not in_place):
            chunk[r0:r1].copy_(slots[r][r0:r1])
    es = chunk.element_size()
    count(ctx, m * es, ((p - 1) * (s1 - s0) + m - (s1 - s0)) * es)


def _accumulate(mine: torch.Tensor, slots: list[torch.Tensor], s0: int, s1: int, me: int,
                op: ReduceOp) -> bool:
    """Reduce segment [s0, s1) of every rank in rank order. True: the result is in ``mine``
    (this rank's own segment of the tensor); False: it is in ``slots[me][s0:s1]``."""
    kernel, p = KERNELS[op], len(slots)
    if me == 0 or (me == 1 and op in COMMUTATIVE):
        first = 1 if me == 0 else 0  # rank 1: x1 ⊕ x0, bit-equal to x0 ⊕ x1
        kernel(mine, slots[first][s0:s1], out=mine)
        for r in range(2, p):
            kernel(mine, slots[r][s0:s1], out=mine)
        return True
    parts = [mine if r == me else slots[r][s0:s1] for r in range(p)]
    reduce_into(slots[me][s0:s1], parts, op)
    return False
