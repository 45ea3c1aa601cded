"""Ring algorithms: bandwidth-optimal all-reduce = reduce-scatter + all-gather on a ring.

Patarasuk & Yuan (2009), popularised for deep learning by Baidu (Gibiansky 2017) and
Horovod. The vector is cut into p segments. In p−1 reduce-scatter steps each rank sends one
segment to its right neighbour and adds the segment arriving from its left one; after them
rank r holds the full sum of one segment. p−1 all-gather steps then pass the finished
segments round the ring::

    step:        0            1            2          (p = 3, segments a b c)
    r0 ─▶ r1   send a0     send c0+c2     ...         each rank sends 2(p−1)·V/p bytes:
    r1 ─▶ r2   send b1     send a0+a1     ...         independent of p, the optimum
    r2 ─▶ r0   send c2     send b1+b2     ...         for a bandwidth-bound link

Each segment is streamed in sub-chunks of ``ctx.chunk_bytes``: a sub-chunk is reduced and
forwarded as soon as it lands, so the reduction overlaps the transfer of the next sub-chunk,
and every rank is sending and receiving at the same time.
"""

from __future__ import annotations

import torch

from disttrain.comm.algorithms.chunking import chunk_elems, segment_bounds, sub_chunks
from disttrain.comm.context import CollectiveContext, Pending
from disttrain.comm.ops import ReduceOp, combine_


def reduce_scatter_inplace(
    ctx: CollectiveContext,
    buf: torch.Tensor,
    bounds: list[tuple[int, int]],
    op: ReduceOp,
    *,
    owned_shift: int,
) -> None:
    """Ring reduce-scatter in place over ``buf``; rank r ends owning the full reduction of
    segment ``(r + owned_shift) % p``. Other segments are left partially reduced."""
    p, r = ctx.world_size, ctx.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    per_chunk = chunk_elems(ctx.chunk_bytes, buf.element_size())

    # Rank r receives at step s the segment it forwards at s + 1; the last one it receives
    # (step p − 2) has then passed every rank once: that is the segment it owns.
    def send_seg(step: int) -> int:
        return (r + owned_shift - step - 1) % p

    def recv_seg(step: int) -> int:
        return (r + owned_shift - step - 2) % p

    longest = max(end - start for start, end in bounds)
    scratch = [buf.new_empty(longest), buf.new_empty(longest)]

    def post_recvs(step: int) -> list[Pending]:
        start, end = bounds[recv_seg(step)]
        tmp = scratch[step % 2]
        return [ctx.irecv(tmp[a - start : b - start], left, step)
                for a, b in sub_chunks(start, end, per_chunk)]

    start0, end0 = bounds[send_seg(0)]
    sends = [ctx.isend(buf[a:b], right, 0) for a, b in sub_chunks(start0, end0, per_chunk)]
    recvs = post_recvs(0)
    for step in range(p - 1):
        following = post_recvs(step + 1) if step + 2 < p else []
        start, end = bounds[recv_seg(step)]
        tmp = scratch[step % 2]
        for (a, b), pending in zip(sub_chunks(start, end, per_chunk), recvs):
            ctx.wait(pending)
            combine_(buf[a:b], tmp[a - start : b - start], op)
            if step + 2 < p:
                sends.append(ctx.isend(buf[a:b], right, step + 1))
        recvs = following
    ctx.wait_all(sends)


def all_gather_inplace(
    ctx: CollectiveContext, buf: torch.Tensor, bounds: list[tuple[int, int]], *, owned_shift: int,
    step_offset: int = 0,
) -> None:
    """Ring all-gather in place: rank r starts owning segment ``(r + owned_shift) % p`` and
    ends with every segment. Arriving sub-chunks are forwarded at once."""
    p, r = ctx.world_size, ctx.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    per_chunk = chunk_elems(ctx.chunk_bytes, buf.element_size())
    recvs = []
    for step in range(p - 1):
        start, end = bounds[(r + owned_shift - 1 - step) % p]
        recvs.append([(a, b, ctx.irecv(buf[a:b], left, step_offset + step))
                      for a, b in sub_chunks(start, end, per_chunk)])
    start0, end0 = bounds[(r + owned_shift) % p]
    sends = [ctx.isend(buf[a:b], right, step_offset)
             for a, b in sub_chunks(start0, end0, per_chunk)]
    for step in range(p - 1):
        for a, b, pending in recvs[step]:
            ctx.wait(pending)
            if step + 2 < p:
                sends.append(ctx.isend(buf[a:b], right, step_offset + step + 1))
    ctx.wait_all(sends)


def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, op: ReduceOp) -> None:
    bounds = segment_bounds(tensor.numel(), ctx.world_size)
    reduce_scatter_inplace(ctx, tensor, bounds, op, owned_shift=1)
    all_gather_inplace(ctx, tensor, bounds, owned_shift=1, step_offset=ctx.world_size)


def reduce_scatter(
    ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
) -> None:
    n = output.numel()
    work = tensor.clone()  # the input stays untouched, as torch's reduce_scatter leaves it
    bounds = [(i * n, (i + 1) * n) for i in range(ctx.world_size)]
    reduce_scatter_inplace(ctx, work, bounds, op, owned_shift=0)
    output.copy_(work[ctx.rank * n : (ctx.rank + 1) * n])


def all_gather(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor) -> None:
    n = tensor.numel()
    output[ctx.rank * n : (ctx.rank + 1) * n].copy_(tensor)
    bounds = [(i * n, (i + 1) * n) for i in range(ctx.world_size)]
    all_gather_inplace(ctx, output, bounds, owned_shift=0)
