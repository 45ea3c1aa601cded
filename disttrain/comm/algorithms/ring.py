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
and every rank is sending and receiving at the same time. Every receive of the whole
collective is posted before the first send (see :func:`post_reduce_scatter`), and in an
all-reduce each sub-chunk of the owned segment starts its all-gather journey as soon as its
last reduction is done, while the next sub-chunk is still being reduced.

Where a pair's messages match in posting order whatever their tags (NCCL, see
``Transport.in_order``), three ranks or more still work unchanged: each pair carries one
direction only, and the receives are posted in the order the left neighbour sends. Two
ranks exchange each phase in one rank-ordered swap instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disttrain.comm.algorithms.chunking import chunk_elems, segment_bounds, sub_chunks
from disttrain.comm.context import CollectiveContext, Pending
from disttrain.comm.ops import ReduceOp, combine_

Received = list[tuple[int, int, torch.Tensor, Pending]]  # (start, end, landing, message)


def post_reduce_scatter(ctx: CollectiveContext, buf: torch.Tensor,
                        bounds: list[tuple[int, int]], *, owned_shift: int) -> list[Received]:
    """Post every receive of a ring reduce-scatter at once, each into its own scratch.

    Why all at once: Gloo moves a message only after the receiver has announced its buffer
    (a round trip between the two processes' I/O threads). Posting every receive before the
    first send takes those announcements off the critical path, as Gloo's own C++ ring does
    with its pre-registered buffers. The price: (p−1)/p·V of scratch instead of 2/p·V.
    """
    p, r = ctx.world_size, ctx.rank
    left = (r - 1) % p
    per_chunk = chunk_elems(ctx.chunk_bytes, buf.element_size())
    longest = max(end - start for start, end in bounds)
    scratch = ctx.scratch(max(0, p - 1) * longest, buf)
    posted = []
    for step in range(p - 1):
        start, end = bounds[(r + owned_shift - step - 2) % p]
        base = step * longest - start  # buf[a:b] of this step lands at scratch[base+a:base+b]
        posted.append([(a, b, landing, ctx.irecv(landing, left, step))
                       for a, b in sub_chunks(start, end, per_chunk)
                       for landing in (scratch[base + a : base + b],)])
    return posted


def reduce_scatter_inplace(
    ctx: CollectiveContext,
    buf: torch.Tensor,
    bounds: list[tuple[int, int]],
    op: ReduceOp,
    *,
    owned_shift: int,
    posted: list[Received],
    finished: Callable[[int, int], None] | None = None,
) -> None:
    """Ring reduce-scatter in place over ``buf``, receiving through ``posted``
    (:func:`post_reduce_scatter`); rank r ends owning the full reduction of segment
    ``(r + owned_shift) % p``. Other segments are left partially reduced. ``finished(a,
    b)`` is called as soon as ``buf[a:b]`` of the owned segment holds its final value (an
    all-reduce starts its all-gather there, while the rest is still being reduced)."""
    p, r = ctx.world_size, ctx.rank
    right = (r + 1) % p
    per_chunk = chunk_elems(ctx.chunk_bytes, buf.element_size())
    # Rank r receives at step s the segment it forwards at s + 1; the last one it receives
    # (step p − 2) has then passed every rank once: that is the segment it owns.
    start0, end0 = bounds[(r + owned_shift - 1) % p]
    sends = [ctx.isend(buf[a:b], right, 0) for a, b in sub_chunks(start0, end0, per_chunk)]
    for step in range(p - 1):
        for a, b, landing, pending in posted[step]:
            ctx.wait(pending)  # reduce each sub-chunk as it lands: the next one is in flight
            combine_(buf[a:b], landing, op)
            if step + 2 < p:
                sends.append(ctx.isend(buf[a:b], right, step + 1))
            elif finished is not None:
                finished(a, b)
    ctx.wait_all(sends)


def post_all_gather(ctx: CollectiveContext, buf: torch.Tensor, bounds: list[tuple[int, int]],
                    *, owned_shift: int, step_offset: int = 0) -> list[Received]:
    """Post every receive of a ring all-gather at once, straight into ``buf``.

    Safe to post before a reduce-scatter over the same ``buf`` has run: the segment that
    arrives at all-gather step s is the one this rank sent at reduce-scatter step s, and its
    owner can only send it after that send has travelled the ring (its own reduce-scatter
    depends on it), so nothing lands in a region this rank still reads or writes.
    """
    p, r = ctx.world_size, ctx.rank
    left = (r - 1) % p
    per_chunk = chunk_elems(ctx.chunk_bytes, buf.element_size())
    posted = []
    for step in range(p - 1):
        start, end = bounds[(r + owned_shift - 1 - step) % p]
        posted.append([(a, b, buf[a:b], ctx.irecv(buf[a:b], left, step_offset + step))
                       for a, b in sub_chunks(start, end, per_chunk)])
    return posted


def all_gather_inplace(
    ctx: CollectiveContext, buf: torch.Tensor, bounds: list[tuple[int, int]], *, owned_shift: int,
    posted: list[Received], step_offset: int = 0, first_sends: list[Pending] | None = None,
) -> None:
    """Ring all-gather in place, receiving through ``posted`` (:func:`post_all_gather`):
    rank r starts owning segment ``(r + owned_shift) % p`` and ends with every segment.
    Arriving sub-chunks are forwarded at once. ``first_sends``: the owned segment's sends,
    when the caller already started them (see :func:`all_reduce`)."""
    p, r = ctx.world_size, ctx.rank
    right = (r + 1) % p
    per_chunk = chunk_elems(ctx.chunk_bytes, buf.element_size())
    start0, end0 = bounds[(r + owned_shift) % p]
    sends = first_sends if first_sends is not None else [
        ctx.isend(buf[a:b], right, step_offset) for a, b in sub_chunks(start0, end0, per_chunk)]
    for step in range(p - 1):
        for a, b, _, pending in posted[step]:
            ctx.wait(pending)
            if step + 2 < p:
                sends.append(ctx.isend(buf[a:b], right, step_offset + step + 1))
    ctx.wait_all(sends)


def _pair_in_order(ctx: CollectiveContext) -> bool:
    """Two ranks on a transport that runs a pair's messages in posting order (NCCL): every
    ring message goes both ways over the one pair, and the receives posted ahead on both
    sides would wait for sends queued behind them. Each phase is then one exchange."""
    return ctx.world_size == 2 and ctx.transport.in_order


def _pair_reduce(ctx: CollectiveContext, buf: torch.Tensor, mine: tuple[int, int],
                 other: tuple[int, int], op: ReduceOp) -> None:
    """Two ranks: give the other rank its segment ``other``, reduce ours in place."""
    landing = ctx.scratch(mine[1] - mine[0], buf)
    ctx.wait_all(ctx.exchange(buf[other[0]:other[1]], landing, 1 - ctx.rank))
    combine_(buf[mine[0]:mine[1]], landing, op)


def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, op: ReduceOp) -> None:
    p = ctx.world_size
    if p == 1:
        return
    bounds = segment_bounds(tensor.numel(), p)
    if _pair_in_order(ctx):
        mine, other = bounds[ctx.rank], bounds[1 - ctx.rank]
        _pair_reduce(ctx, tensor, mine, other, op)
        ctx.wait_all(ctx.exchange(tensor[mine[0]:mine[1]], tensor[other[0]:other[1]],
                                  1 - ctx.rank))
        return
    # reduce-scatter receives first: where tags are ignored (NCCL) the left neighbour's
    # messages match in the order it sends them, all of the reduce-scatter's first
    scatters = post_reduce_scatter(ctx, tensor, bounds, owned_shift=1)
    gathers = post_all_gather(ctx, tensor, bounds, owned_shift=1, step_offset=p)
    right, first_sends = (ctx.rank + 1) % p, []

    def start_gather(a: int, b: int) -> None:  # a sub-chunk is final: it can travel now
        first_sends.append(ctx.isend(tensor[a:b], right, p))

    reduce_scatter_inplace(ctx, tensor, bounds, op, owned_shift=1, posted=scatters,
                           finished=start_gather)
    all_gather_inplace(ctx, tensor, bounds, owned_shift=1, posted=gathers, step_offset=p,
                       first_sends=first_sends)


def reduce_scatter(
    ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp
) -> None:
    n = output.numel()
    work = ctx.scratch_copy(tensor)  # the input stays untouched, as torch leaves it
    bounds = [(i * n, (i + 1) * n) for i in range(ctx.world_size)]
    if _pair_in_order(ctx):
        _pair_reduce(ctx, work, bounds[ctx.rank], bounds[1 - ctx.rank], op)
    elif ctx.world_size > 1:
        posted = post_reduce_scatter(ctx, work, bounds, owned_shift=0)
        reduce_scatter_inplace(ctx, work, bounds, op, owned_shift=0, posted=posted)
    output.copy_(work[ctx.rank * n : (ctx.rank + 1) * n])


def all_gather(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor) -> None:
    n = tensor.numel()
    output[ctx.rank * n : (ctx.rank + 1) * n].copy_(tensor)
    if ctx.world_size == 1:
        return
    if _pair_in_order(ctx):
        peer = 1 - ctx.rank
        ctx.wait_all(ctx.exchange(tensor, output[peer * n : (peer + 1) * n], peer))
        return
    bounds = [(i * n, (i + 1) * n) for i in range(ctx.world_size)]
    posted = post_all_gather(ctx, output, bounds, owned_shift=0)
    all_gather_inplace(ctx, output, bounds, owned_shift=0, posted=posted)
