"""What every ``shm`` algorithm shares: the collective area, the barrier step with named
errors, rank-ordered reductions, traffic counting and round sizes.

The algorithms themselves are in ``shm.py`` (all_gather, broadcast, …) and
``shm_all_reduce.py``; docs/shm_transport.md describes the protocols.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disttrain.comm.context import CollectiveContext
from disttrain.comm.errors import CommTimeoutError, PeerFailedError
from disttrain.comm.ops import ReduceOp
from disttrain.comm.transport import Transport
from disttrain.comm.transports.shm import SharedMemoryTransport
from disttrain.comm.transports.shm_collectives import CollectiveArea
from disttrain.comm.transports.shm_sync import ShmPeerDead, ShmPeerTimeout

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
