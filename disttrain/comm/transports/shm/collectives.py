"""``shm``: whole collectives in shared memory, for the ``shm`` transport only.

Instead of messages, ranks copy into their slot of the segment's collective area, meet at a
counter barrier, and read each other's slots directly (the area: ``sync.py``). Large
tensors stream through the fixed-size slots in rounds: per round, every rank writes its
part, one barrier, every rank reads what it needs. all_reduce, the one that matters most,
has its own module (``all_reduce.py``); what every ``shm`` algorithm shares comes first
here: the collective area, the barrier step with named errors, rank-ordered reductions,
traffic counting and round sizes. docs/shm_transport.md describes the protocols.

Reductions always run in rank order, so every rank gets bit-identical results that equal
the single-process reference ``((x0 ⊕ x1) ⊕ x2) …``. Bytes written into the segment count as
sent, bytes read from other ranks' slots as received.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disttrain.comm.algorithms.chunking import sub_chunks
from disttrain.comm.context import CollectiveContext
from disttrain.comm.errors import CommTimeoutError, PeerFailedError
from disttrain.comm.ops import ReduceOp
from disttrain.comm.transport import Transport
from disttrain.comm.transports.shm.sync import CollectiveArea, ShmPeerDead, ShmPeerTimeout
from disttrain.comm.transports.shm.transport import SharedMemoryTransport

KERNELS: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PROD: torch.mul,
    ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum,
}
# Reductions whose kernel gives the same bits in either operand order (IEEE + and × are
# commutative, signed zeros included; torch.minimum/maximum are not for −0.0 against 0.0).
COMMUTATIVE = frozenset({ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD})


def supports(transport: Transport) -> bool:
    """Whether algorithm ``shm`` can run on ``transport`` (``auto`` should ask this)."""
    return isinstance(transport, SharedMemoryTransport)


def area_of(ctx: CollectiveContext) -> CollectiveArea:
    if not isinstance(ctx.transport, SharedMemoryTransport):
        raise ValueError(
            f"algorithm='shm' needs the shared-memory transport, but this communicator's "
            f"transport is {ctx.transport.name!r}; build the Communicator over "
            f"make_transport('shm') (or 'auto'), or pick another algorithm")
    return ctx.transport.collectives


def step(ctx: CollectiveContext, area: CollectiveArea) -> None:
    """One barrier; a late or dead peer becomes an error naming the op and the rank."""
    try:
        area.step(ctx.timeout_s)
    except ShmPeerTimeout as exc:
        raise CommTimeoutError(
            f"{_where(ctx)}: timed out after {ctx.timeout_s:g}s waiting for rank(s) "
            f"{list(exc.peers)} in shared memory; they are stuck, dead, or called a "
            f"different collective", op=ctx.op, seq=ctx.seq, peer=exc.peer) from exc
    except ShmPeerDead as exc:
        raise PeerFailedError(f"{_where(ctx)}: rank {exc.peer} failed while this rank waited "
                              f"for it ({exc})", op=ctx.op, seq=ctx.seq, peer=exc.peer) from exc
    ctx.progressed()  # a barrier passed: the async backstop must not fire


def _where(ctx: CollectiveContext) -> str:
    return f"{ctx.op} #{ctx.seq} (shm) on rank {ctx.rank}"


def reduce_into(out: torch.Tensor, parts: list[torch.Tensor], op: ReduceOp) -> None:
    """out = parts[0] ⊕ parts[1] ⊕ … in that order (``out`` may alias ``parts[0]`` only)."""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    kernel = KERNELS[op]
    kernel(parts[0], parts[1], out=out)
    for part in parts[2:]:
        kernel(out, part, out=out)


def count(ctx: CollectiveContext, sent: int, received: int) -> None:
    ctx.stats.count(ctx.op, sent, received)


def per_round(area: CollectiveArea, tensor: torch.Tensor, share: int = 1) -> int:
    """Elements per round when a slot is shared by ``share`` blocks."""
    return max(1, area.slot_bytes // (tensor.element_size() * share))


# ------------------------------------------------------------- the collectives
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


__all__ = ["all_gather", "all_to_all", "barrier", "broadcast", "gather", "reduce",
           "reduce_scatter", "scatter", "supports"]
