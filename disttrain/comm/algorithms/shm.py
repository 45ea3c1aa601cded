"""``shm``: whole collectives in shared memory, for the ``shm`` transport only.

Instead of messages, ranks copy into their slot of the segment's collective area, meet at a
counter barrier, and read each other's slots directly (``transports/shm_collectives.py``).
Large tensors stream through the fixed-size slots in rounds. all_reduce has two shapes:

    one-shot (≤ one_shot_max_bytes)       reduce-scatter + all-gather (larger), per round:
    r: copy x → slot[r]                   r: copy chunk → slot[r]
    ── barrier ──                         ── barrier ──
    r: x = slot[0] ⊕ … ⊕ slot[p−1]        r: seg_r = slot[0][seg_r] ⊕ … ⊕ slot[p−1][seg_r],
       (every rank, identical order)         written back to slot[r][seg_r]
                                          ── barrier ──
                                          r: copy slot[i][seg_i] → chunk[seg_i] for all i

Reductions always run in rank order, so every rank gets bit-identical results that equal
the single-process reference ``((x0 ⊕ x1) ⊕ x2) …``. The same idea ships in DeepSpeed's CPU
inference all-reduce (docs/shm_transport.md). Bytes written into the segment count as sent,
bytes read from other ranks' slots as received.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disttrain.comm.algorithms.chunking import segment_bounds, sub_chunks
from disttrain.comm.context import CollectiveContext
from disttrain.comm.errors import CommTimeoutError, PeerFailedError
from disttrain.comm.ops import ReduceOp
from disttrain.comm.transport import Transport
from disttrain.comm.transports.shm import SharedMemoryTransport
from disttrain.comm.transports.shm_collectives import CollectiveArea
from disttrain.comm.transports.shm_sync import ShmPeerDead, ShmPeerTimeout

_KERNELS: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PROD: torch.mul,
    ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
}


def supports(transport: Transport) -> bool:
    """Whether algorithm ``shm`` can run on ``transport`` (``auto`` should ask this)."""
    return isinstance(transport, SharedMemoryTransport)


def _area(ctx: CollectiveContext) -> CollectiveArea:
    if not isinstance(ctx.transport, SharedMemoryTransport):
        raise ValueError(
            f"algorithm='shm' needs the shared-memory transport, but this communicator's "
            f"transport is {ctx.transport.name!r}; build the Communicator over "
            f"make_transport('shm') (or 'auto'), or pick another algorithm")
    return ctx.transport.collectives


def _step(ctx: CollectiveContext, area: CollectiveArea) -> None:
    """One barrier; a late or dead peer becomes an error naming the op and the rank."""
    where = f"{ctx.op} #{ctx.seq} (shm) on rank {ctx.rank}"
    try:
        area.step(ctx.timeout_s)
    except ShmPeerTimeout as exc:
        raise CommTimeoutError(
            f"{where}: timed out after {ctx.timeout_s:g}s waiting for rank(s) "
            f"{list(exc.peers)} in shared memory; they are stuck, dead, or called a "
            f"different collective", op=ctx.op, seq=ctx.seq, peer=exc.peer) from exc
    except ShmPeerDead as exc:
        raise PeerFailedError(f"{where}: rank {exc.peer} failed while this rank waited for "
                              f"it ({exc})", op=ctx.op, seq=ctx.seq, peer=exc.peer) from exc
    ctx.progressed()  # a barrier passed: the async backstop must not fire


def _reduce_into(out: torch.Tensor, parts: list[torch.Tensor], op: ReduceOp) -> None:
    """out = parts[0] ⊕ parts[1] ⊕ … in that order (``out`` may not alias any part)."""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    kernel = _KERNELS[op]
    kernel(parts[0], parts[1], out=out)
    for part in parts[2:]:
        kernel(out, part, out=out)


def _count(ctx: CollectiveContext, sent: int, received: int) -> None:
    if sent:
        ctx.stats.count_send(ctx.op, sent)
    if received:
        ctx.stats.count_recv(ctx.op, received)


def _per_round(area: CollectiveArea, tensor: torch.Tensor, share: int = 1) -> int:
    """Elements per round when a slot is shared by ``share`` blocks."""
    return max(1, area.slot_bytes // (tensor.element_size() * share))


# ---------------------------------------------------------------------------- all_reduce
def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, op: ReduceOp) -> None:
    area = _area(ctx)
    if ctx.world_size == 1 or tensor.numel() == 0:
        return
    if tensor.numel() * tensor.element_size() <= area.one_shot_max_bytes:
        _one_shot(ctx, area, tensor, op)
    else:
        for a, b in sub_chunks(0, tensor.numel(), _per_round(area, tensor)):
            _two_phase(ctx, area, tensor[a:b], op)


def _one_shot(ctx: CollectiveContext, area: CollectiveArea, x: torch.Tensor,
              op: ReduceOp) -> None:
    n, p = x.numel(), ctx.world_size
    slots = area.slots(area.begin_round(), x.dtype)
    slots[ctx.rank][:n].copy_(x)
    _step(ctx, area)
    _reduce_into(x, [slots[r][:n] for r in range(p)], op)
    nbytes = n * x.element_size()
    _count(ctx, nbytes, (p - 1) * nbytes)


def _two_phase(ctx: CollectiveContext, area: CollectiveArea, chunk: torch.Tensor,
               op: ReduceOp) -> None:
    """One round of reduce-scatter + all-gather over ``chunk`` (≤ one slot). Rank r never
    needs its own segment in shared memory as an input, so it copies in only the others'
    segments and reduces (its private copy ⊕ the others', in rank order) straight into
    the free ``slot[r][seg_r]``, where the others then read the result."""
    p, me, m = ctx.world_size, ctx.rank, chunk.numel()
    slots = area.slots(area.begin_round(), chunk.dtype)
    bounds = segment_bounds(m, p)
    s0, s1 = bounds[me]
    slots[me][:s0].copy_(chunk[:s0])
    slots[me][s1:m].copy_(chunk[s1:])
    _step(ctx, area)
    if s1 > s0:
        parts = [chunk[s0:s1] if r == me else slots[r][s0:s1] for r in range(p)]
        _reduce_into(slots[me][s0:s1], parts, op)
    _step(ctx, area)
    for r in range(p):
        r0, r1 = bounds[r]
        if r1 > r0:
            chunk[r0:r1].copy_(slots[r][r0:r1])
    es = chunk.element_size()
    _count(ctx, m * es, ((p - 1) * (s1 - s0) + m - (s1 - s0)) * es)


# ---------------------------------------------------------------------------- the others
def reduce_scatter(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor,
                   op: ReduceOp) -> None:
    area = _area(ctx)
    p, me, n = ctx.world_size, ctx.rank, output.numel()
    if p == 1:
        output.copy_(tensor)
        return
    blocks = tensor.view(p, n)
    for a, b in sub_chunks(0, n, _per_round(area, tensor, p)):
        m = b - a
        slots = area.slots(area.begin_round(), tensor.dtype)
        slots[me][: p * m].view(p, m).copy_(blocks[:, a:b])  # block j → slot[me][j·m …]
        _step(ctx, area)
        _reduce_into(output[a:b], [slots[r][me * m : (me + 1) * m] for r in range(p)], op)
        _count(ctx, p * m * tensor.element_size(), (p - 1) * m * tensor.element_size())


def all_gather(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor) -> None:
    area = _area(ctx)
    p, me, n = ctx.world_size, ctx.rank, tensor.numel()
    out = output.view(p, n)
    for a, b in sub_chunks(0, n, _per_round(area, tensor)):
        m, s = b - a, area.begin_round()
        area.slots(s, tensor.dtype)[me][:m].copy_(tensor[a:b])
        _step(ctx, area)
        out[:, a:b].copy_(area.region(s, tensor.dtype).view(p, -1)[:, :m])
        _count(ctx, m * tensor.element_size(), (p - 1) * m * tensor.element_size())


def broadcast(ctx: CollectiveContext, tensor: torch.Tensor, root: int) -> None:
    area = _area(ctx)
    if ctx.world_size == 1:
        return
    for a, b in sub_chunks(0, tensor.numel(), _per_round(area, tensor) * ctx.world_size):
        region = area.region(area.begin_round(), tensor.dtype)  # the root fills all p slots
        nbytes = (b - a) * tensor.element_size()
        if ctx.rank == root:
            region[: b - a].copy_(tensor[a:b])
        _step(ctx, area)
        if ctx.rank != root:
            tensor[a:b].copy_(region[: b - a])
        _count(ctx, nbytes if ctx.rank == root else 0, 0 if ctx.rank == root else nbytes)


def reduce(ctx: CollectiveContext, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
    area = _area(ctx)
    p, me = ctx.world_size, ctx.rank
    if p == 1:
        return
    for a, b in sub_chunks(0, tensor.numel(), _per_round(area, tensor)):
        m = b - a
        slots = area.slots(area.begin_round(), tensor.dtype)
        slots[me][:m].copy_(tensor[a:b])
        _step(ctx, area)
        if me == root:
            _reduce_into(tensor[a:b], [slots[r][:m] for r in range(p)], op)
        nbytes = m * tensor.element_size()
        _count(ctx, nbytes, (p - 1) * nbytes if me == root else 0)


def gather(ctx: CollectiveContext, output: torch.Tensor | None, tensor: torch.Tensor,
           root: int) -> None:
    area = _area(ctx)
    p, me, n = ctx.world_size, ctx.rank, tensor.numel()
    for a, b in sub_chunks(0, n, _per_round(area, tensor)):
        m, s = b - a, area.begin_round()
        area.slots(s, tensor.dtype)[me][:m].copy_(tensor[a:b])
        _step(ctx, area)
        if output is not None:
            output.view(p, n)[:, a:b].copy_(area.region(s, tensor.dtype).view(p, -1)[:, :m])
        nbytes = m * tensor.element_size()
        _count(ctx, nbytes, (p - 1) * nbytes if me == root else 0)


def scatter(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor | None,
            root: int) -> None:
    area = _area(ctx)
    p, me, n = ctx.world_size, ctx.rank, output.numel()
    for a, b in sub_chunks(0, n, _per_round(area, output)):
        m, s = b - a, area.begin_round()
        if tensor is not None:  # the root writes block j into slot j
            area.region(s, output.dtype).view(p, -1)[:, :m].copy_(tensor.view(p, n)[:, a:b])
        _step(ctx, area)
        output[a:b].copy_(area.slots(s, output.dtype)[me][:m])
        nbytes = m * output.element_size()
        _count(ctx, (p - 1) * nbytes if me == root else 0, 0 if me == root else nbytes)


def barrier(ctx: CollectiveContext) -> None:
    _step(ctx, _area(ctx))


def all_to_all(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor,
               out_splits: list[int], in_splits: list[int]) -> None:
    """Slot of rank r = [r's send and receive splits | sub-slot for rank 0 | … | for p−1];
    rank d reads sub-slot d of every slot. Splits travel in round 0, so every rank knows
    how many rounds the largest block needs (and every rank sees a split mismatch)."""
    area = _area(ctx)
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
        _step(ctx, area)
        if k == 0:
            rounds = _rounds_for_splits(area, s, p, per)
        for r in range(p):
            lo, hi = k * per, min((k + 1) * per, out_splits[r])
            if r != me and hi > lo:
                at = (meta + me * sub) // es
                output[out_off[r] + lo : out_off[r] + hi].copy_(slots[r][at : at + hi - lo])
                received += (hi - lo) * es
        _count(ctx, sent, received)
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
