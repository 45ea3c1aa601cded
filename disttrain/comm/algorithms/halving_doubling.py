"""Recursive halving and doubling (Rabenseifner; Thakur, Rabenseifner & Gropp 2005).

All-reduce = reduce-scatter by recursive *halving* + all-gather by recursive *doubling*.
In halving step k a rank swaps half of its current range with the partner at distance
q/2^(k+1) and reduces the half it keeps; doubling retraces the steps, swapping what each
holds, so ranges double back to the whole vector::

    q = 4, vector [A B C D]
    halving  d=2: r0⇄r2, r1⇄r3   r0,r1 keep [A B], r2,r3 keep [C D]
             d=1: r0⇄r1, r2⇄r3   r0 keeps A, r1 B, r2 C, r3 D (each fully reduced)
    doubling d=1, then d=2:      everyone ends with [A B C D]

2·log₂ q messages (latency like a tree) and 2(q−1)/q·V bytes (bandwidth like a ring).
A non-power-of-two p folds first: of the first 2(p−q) ranks each even rank hands its data
to the odd rank above it and sits out, and receives the result at the end (``fold_map``).
"""

from __future__ import annotations

import torch

from disttrain.comm.algorithms.chunking import fold_map, segment_bounds, virtual_rank
from disttrain.comm.context import CollectiveContext
from disttrain.comm.ops import ReduceOp, combine_

_FOLD, _UNFOLD, _STEPS = 0, 1, 2  # tag steps: fold, unfold, then one per halving/doubling


def _span(vbounds: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    return vbounds[lo][0], vbounds[hi - 1][1]


def _real_rank(v: int, members: list[list[int]]) -> int:
    return members[v][-1]  # the participating rank of virtual rank v


def _halving(ctx: CollectiveContext, buf: torch.Tensor, vbounds: list[tuple[int, int]],
             vr: int, q: int, members: list[list[int]], op: ReduceOp) -> None:
    lo, hi, dist, step = 0, q, q // 2, _STEPS
    tmp = ctx.scratch_like(buf)
    while dist >= 1:
        partner = _real_rank(vr ^ dist, members)
        mid = lo + dist
        keep, give = ((lo, mid), (mid, hi)) if not vr & dist else ((mid, hi), (lo, mid))
        ks, ke = _span(vbounds, *keep)
        gs, ge = _span(vbounds, *give)
        ctx.sendrecv(buf[gs:ge], partner, tmp[ks:ke], partner, step)
        combine_(buf[ks:ke], tmp[ks:ke], op)
        lo, hi = keep
        dist //= 2
        step += 1


def _doubling(ctx: CollectiveContext, buf: torch.Tensor, vbounds: list[tuple[int, int]],
              vr: int, q: int, members: list[list[int]]) -> None:
    dist, step = 1, _STEPS + 64
    while dist < q:
        lo = (vr // dist) * dist
        plo = ((vr ^ dist) // dist) * dist
        ms, me = _span(vbounds, lo, lo + dist)
        ps, pe = _span(vbounds, plo, plo + dist)
        ctx.sendrecv(buf[ms:me], _real_rank(vr ^ dist, members), buf[ps:pe],
                     _real_rank(vr ^ dist, members), step)
        dist *= 2
        step += 1


def _virtual_bounds(
    bounds: list[tuple[int, int]], members: list[list[int]]
) -> list[tuple[int, int]]:
    return [(bounds[m[0]][0], bounds[m[-1]][1]) for m in members]


def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, op: ReduceOp) -> None:
    p, r = ctx.world_size, ctx.rank
    if p == 1:
        return
    q, members = fold_map(p)
    vr = virtual_rank(r, p)
    if vr is None:  # folded: hand over the data, get the result back
        ctx.send(tensor, r + 1, _FOLD)
        ctx.recv(tensor, r + 1, _UNFOLD)
        return
    if len(members[vr]) == 2:
        tmp = ctx.scratch_like(tensor)
        ctx.recv(tmp, r - 1, _FOLD)
        combine_(tensor, tmp, op)
    vbounds = segment_bounds(tensor.numel(), q)
    _halving(ctx, tensor, vbounds, vr, q, members, op)
    _doubling(ctx, tensor, vbounds, vr, q, members)
    if len(members[vr]) == 2:
        ctx.send(tensor, r - 1, _UNFOLD)


def reduce_scatter(
    ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
) -> None:
    p, r, n = ctx.world_size, ctx.rank, output.numel()
    q, members = fold_map(p)
    vr = virtual_rank(r, p)
    if vr is None:
        ctx.send(tensor, r + 1, _FOLD)
        ctx.recv(output, r + 1, _UNFOLD)
        return
    work = ctx.scratch_copy(tensor)
    if len(members[vr]) == 2:
        tmp = ctx.scratch_like(tensor)
        ctx.recv(tmp, r - 1, _FOLD)
        combine_(work, tmp, op)
    bounds = [(i * n, (i + 1) * n) for i in range(p)]
    _halving(ctx, work, _virtual_bounds(bounds, members), vr, q, members, op)
    if len(members[vr]) == 2:
        ctx.send(work[(r - 1) * n : r * n], r - 1, _UNFOLD)
    output.copy_(work[r * n : (r + 1) * n])


def all_gather(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor) -> None:
    p, r, n = ctx.world_size, ctx.rank, tensor.numel()
    q, members = fold_map(p)
    vr = virtual_rank(r, p)
    output[r * n : (r + 1) * n].copy_(tensor)
    if vr is None:
        ctx.send(tensor, r + 1, _FOLD)
        ctx.recv(output, r + 1, _UNFOLD)
        return
    if len(members[vr]) == 2:
        ctx.recv(output[(r - 1) * n : r * n], r - 1, _FOLD)
    bounds = [(i * n, (i + 1) * n) for i in range(p)]
    _doubling(ctx, output, _virtual_bounds(bounds, members), vr, q, members)
    if len(members[vr]) == 2:
        ctx.send(output, r - 1, _UNFOLD)
