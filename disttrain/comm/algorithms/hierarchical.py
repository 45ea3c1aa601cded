"""``hierarchical``: collectives across machines in three legs, as Horovod's hierarchical
all-reduce (``HOROVOD_HIERARCHICAL_ALLREDUCE``; NCCL/MPI "reduce, cross-node allreduce, bcast").

Ranks on one machine talk through shared memory; only one *leader* per machine (its lowest
rank) talks over the network, so the network carries V per leader instead of V per rank::

    node 0: r0 r1   node 1: r2 r3           all_reduce(V), op ⊕
    1. r1 ──shm──▶ r0      r3 ──shm──▶ r2   intra-node reduce onto the leader
    2.       r0 ◀══ network ══▶ r2          all_reduce among leaders (torch transport)
    3. r0 ──shm──▶ r1      r2 ──shm──▶ r3   intra-node broadcast from the leader

broadcast runs the same legs from the root's node outwards; all_gather gathers each node's
blocks onto its leader, all-gathers node blocks among leaders and broadcasts the result.
Which ranks share a node is found once (``disttrain.comm.topology``); the intra-node
communicators (``shm`` transport when it works, else ``torch``) and the leaders' communicator
(``torch`` transport) are built on the first call, or by ``Communicator.build_hierarchy``,
and owned by the communicator (``ctx.hierarchy()``). Cost model and when it wins:
docs/hierarchical.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from disttrain.comm.context import CollectiveContext
from disttrain.comm.errors import CommError, CommTimeoutError, PeerFailedError
from disttrain.comm.ops import ReduceOp
from disttrain.comm.topology import Hierarchy, gather_slots

NAME = "hierarchical"


def _for_context(ctx: CollectiveContext) -> Hierarchy:
    """The calling communicator's hierarchy, built (collectively) on its first use."""
    built: Hierarchy = ctx.hierarchy()
    return built


# ---------------------------------------------------------------------------- the legs
@contextmanager
def _leg(ctx: CollectiveContext, what: str, members: Sequence[int]) -> Iterator[None]:
    """Run one leg; an error from a sub-communicator is re-raised naming this collective
    and the ranks of the sub-group as ranks of the parent communicator."""
    try:
        yield
    except CommError as exc:
        raise _renamed(ctx, what, members, exc) from exc
    ctx.progressed()  # a leg finished: the async backstop must not fire


def _renamed(ctx: CollectiveContext, what: str, members: Sequence[int],
             exc: CommError) -> CommError:
    text = (f"{ctx.op} #{ctx.seq} (hierarchical) on rank {ctx.rank}: the {what} among ranks "
            f"{list(members)} failed (their ranks 0..{len(members) - 1} below, in that "
            f"order): {exc}")
    if isinstance(exc, (CommTimeoutError, PeerFailedError)):
        peer = members[exc.peer] if exc.peer is not None and exc.peer < len(members) else None
        suspects = tuple(members[s] for s in exc.suspects if s < len(members))
        return type(exc)(text, op=ctx.op, seq=ctx.seq, peer=peer, suspects=suspects)
    return CommError(text)


def _totals(h: Hierarchy) -> tuple[int, int, int]:
    t = h.traffic()
    sent, recv = t["intra_bytes_sent"] + t["inter_bytes_sent"], t["intra_bytes_recv"]
    return sent, recv + t["inter_bytes_recv"], t["inter_bytes_unobserved"]


def _count(ctx: CollectiveContext, h: Hierarchy, before: tuple[int, int, int]) -> None:
    """Add what the legs moved to the parent communicator's counters for this op."""
    sent, recv, unobserved = (a - b for a, b in zip(_totals(h), before, strict=True))
    if sent:
        ctx.stats.count_send(ctx.op, sent)
    if recv:
        ctx.stats.count_recv(ctx.op, recv)
    if unobserved:
        ctx.stats.count_unobserved(unobserved)


# ---------------------------------------------------------------------------- collectives
def all_reduce(ctx: CollectiveContext, tensor: torch.Tensor, op: ReduceOp) -> None:
    if ctx.world_size == 1 or tensor.numel() == 0:
        return
    h = _for_context(ctx)
    inner = ReduceOp.SUM if op is ReduceOp.AVG else op  # the Communicator divides once
    before = _totals(h)
    if h.intra is not None:
        with _leg(ctx, "intra-node reduce", h.node):
            h.intra.reduce(tensor, 0, inner)
    if h.inter is not None:
        with _leg(ctx, "inter-node all_reduce", h.layout.leaders):
            h.inter.all_reduce(tensor, inner)
    if h.intra is not None:
        with _leg(ctx, "intra-node broadcast", h.node):
            h.intra.broadcast(tensor, 0)
    _count(ctx, h, before)


def broadcast(ctx: CollectiveContext, tensor: torch.Tensor, root: int) -> None:
    if ctx.world_size == 1 or tensor.numel() == 0:
        return
    h = _for_context(ctx)
    layout, before = h.layout, _totals(h)
    root_node = layout.node_of(root)
    at_root_node = layout.node_of(ctx.rank) == root_node
    if at_root_node and h.intra is not None:  # the root's node first: its leader needs it
        with _leg(ctx, "intra-node broadcast", h.node):
            h.intra.broadcast(tensor, layout.local_rank(root))
    if h.inter is not None:
        with _leg(ctx, "inter-node broadcast", layout.leaders):
            h.inter.broadcast(tensor, root_node)
    if not at_root_node and h.intra is not None:
        with _leg(ctx, "intra-node broadcast", h.node):
            h.intra.broadcast(tensor, 0)
    _count(ctx, h, before)


def all_gather(ctx: CollectiveContext, output: torch.Tensor, tensor: torch.Tensor) -> None:
    n = tensor.numel()
    if ctx.world_size == 1 or n == 0:
        output.copy_(tensor)
        return
    h = _for_context(ctx)
    before = _totals(h)
    if h.is_leader:
        _leader_gather(ctx, h, output, tensor)
    elif h.intra is not None:
        with _leg(ctx, "intra-node gather", h.node):
            h.intra.gather(None, tensor, 0)
    if h.intra is not None:
        with _leg(ctx, "intra-node broadcast", h.node):
            h.intra.broadcast(output, 0)
    _count(ctx, h, before)


def _leader_gather(ctx: CollectiveContext, h: Hierarchy, output: torch.Tensor,
                   tensor: torch.Tensor) -> None:
    """Gather this node's blocks, all-gather node blocks among leaders (padded to the
    largest node), and put every block at its rank's place in ``output``."""
    n, layout = tensor.numel(), h.layout
    slots = gather_slots(layout)
    width = layout.max_node_size
    # one node: its blocks are all blocks, already in rank order
    node_blocks = output if h.inter is None else torch.empty(width * n, dtype=tensor.dtype)
    if h.intra is not None:
        with _leg(ctx, "intra-node gather", h.node):
            h.intra.gather(node_blocks[: len(h.node) * n], tensor, 0)
    else:
        node_blocks[:n].copy_(tensor)
    if h.inter is None:
        return
    # consecutive, equal-sized nodes: the leaders' all-gather lands in rank order already
    in_place = (output.numel() == layout.num_nodes * width * n
                and all(rank == slot for rank, slot in slots))
    staged = output if in_place else torch.empty(layout.num_nodes * width * n,
                                                 dtype=tensor.dtype)
    with _leg(ctx, "inter-node all_gather", layout.leaders):
        h.inter.all_gather(staged, node_blocks)
    if not in_place:
        for rank, slot in slots:
            output[rank * n : (rank + 1) * n].copy_(staged[slot * n : (slot + 1) * n])


def register(table: dict[str, dict[str, Any]]) -> None:
    """Add ``hierarchical`` to the algorithm registry (``algorithms/__init__.py``)."""
    table["all_reduce"][NAME] = all_reduce
    table["broadcast"][NAME] = broadcast
    table["all_gather"][NAME] = all_gather
