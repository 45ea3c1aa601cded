"""Which ranks share a machine, and the sub-communicators hierarchical collectives run on.

A *node* here is a set of ranks that can exchange data through shared memory. Every rank
contributes a key, the keys are all-gathered, and ranks with equal keys form one node
(:func:`group_by_key`, a pure function). The key is, in order of precedence:

1. an explicit ``node_id`` (``HierarchyConfig(node_id=...)``, per rank),
2. the environment variable ``DISTTRAIN_NODE_ID`` (e.g. to simulate two machines on one),
3. the shared-memory host key: host name, boot id, and the mount, pid and network
   namespaces (``transports/shm/segment.host_key``).

The default answers the question the algorithm actually asks, "who can share memory with
me?", rather than "which launcher started me?" (``GROUP_RANK``): two launchers on one host
still form one node, and two network namespaces on one kernel (the launcher tests'
"machines") form two, because the ``shm`` transport refuses to join ranks whose network
namespaces differ. Nodes are numbered by their lowest rank; that rank is the node's
*leader*, the only one whose bytes cross the network.

:func:`build` then makes one intra-node communicator per node (``shm`` transport when it
works) and one among the leaders (``torch`` transport): a :class:`Hierarchy`. The
Communicator owns its hierarchy: it builds it (``Communicator.build_hierarchy``, or its
first ``hierarchical`` collective), hands it to the algorithm through the collective's
context, and closes it with itself. This module never imports the Communicator (which
imports it): :func:`build` receives the factory that makes the sub-communicators, and a
:class:`Hierarchy` holds them by what its legs call (:class:`LegCommunicator`). See
docs/hierarchical.md.

The functions that took the communicator, ``build_hierarchy(comm, config)``,
``close_hierarchy(comm)`` and ``hierarchy_of(comm)``, still work and warn once: they are
``comm.build_hierarchy(config)``, ``comm.close_hierarchy()`` and ``comm.hierarchy``.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from disttrain.comm.context import CollectiveContext
from disttrain.comm.errors import CommTimeoutError
from disttrain.comm.ops import ReduceOp
from disttrain.comm.stats import TrafficStats
from disttrain.comm.transport import Transport
from disttrain.comm.transports import TRANSPORTS, SharedMemoryTransport, make_transport
from disttrain.comm.transports.shm.segment import host_key
from disttrain.comm.transports.torch_p2p import TorchTransport, translate_error
from disttrain.deprecated import warn_once

NODE_ID_ENV = "DISTTRAIN_NODE_ID"
KEY_BYTES = 32  # sha256 digests: every rank's key has the same size for the all-gather


@dataclass(frozen=True)
class NodeLayout:
    """Ranks ``0..world_size-1`` partitioned into nodes.

    ``nodes[i]`` lists the ranks of node ``i`` in increasing order, and nodes are ordered by
    their first rank, so node ``i``'s leader ``nodes[i][0]`` is rank ``i`` of the leaders'
    group and local rank 0 of its node. Example: ``((0, 1), (2, 3))`` is 2 nodes × 2 ranks.
    """

    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        flat = [r for node in self.nodes for r in node]
        if not self.nodes or any(not node for node in self.nodes):
            raise ValueError(f"nodes={self.nodes!r} must be non-empty tuples of ranks")
        if sorted(flat) != list(range(len(flat))):
            raise ValueError(f"nodes={self.nodes!r} must list each rank 0..{len(flat) - 1} "
                             f"exactly once")
        if any(list(node) != sorted(node) for node in self.nodes):
            raise ValueError(f"nodes={self.nodes!r}: list the ranks of each node in "
                             f"increasing order")
        firsts = [node[0] for node in self.nodes]
        if firsts != sorted(firsts):
            raise ValueError(f"nodes={self.nodes!r}: order nodes by their lowest rank")

    @property
    def world_size(self) -> int:
        return sum(len(node) for node in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def leaders(self) -> tuple[int, ...]:
        """The lowest rank of each node, in node order (the leaders' group)."""
        return tuple(node[0] for node in self.nodes)

    @property
    def max_node_size(self) -> int:
        return max(len(node) for node in self.nodes)

    def node_of(self, rank: int) -> int:
        """The index of the node that ``rank`` runs on."""
        for index, node in enumerate(self.nodes):
            if rank in node:
                return index
        raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")

    def local_rank(self, rank: int) -> int:
        """``rank``'s position within its node (0 for the leader)."""
        return self.nodes[self.node_of(rank)].index(rank)

    def is_leader(self, rank: int) -> bool:
        return self.local_rank(rank) == 0


def group_by_key(keys: Sequence[Hashable]) -> NodeLayout:
    """Rank ``r`` has key ``keys[r]``; ranks with equal keys share a node.

    >>> group_by_key(["a", "b", "a", "b"]).nodes
    ((0, 2), (1, 3))
    """
    if not keys:
        raise ValueError("group_by_key needs one key per rank, got none")
    nodes: dict[Hashable, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)  # dicts keep first-seen order: lowest rank
    return NodeLayout(tuple(tuple(ranks) for ranks in nodes.values()))


def node_key(node_id: str | None = None, environ: Mapping[str, str] | None = None) -> bytes:
    """This rank's :data:`KEY_BYTES`-byte node key (see the module docstring for the order)."""
    env = os.environ if environ is None else environ
    chosen = node_id if node_id is not None else env.get(NODE_ID_ENV) or None
    if chosen is not None:
        return hashlib.sha256(b"disttrain-node-id\0" + chosen.encode()).digest()
    return host_key()


def gather_slots(layout: NodeLayout) -> list[tuple[int, int]]:
    """``(rank, slot)`` pairs: where each rank's block sits in the leaders' all-gather.

    Every node contributes ``max_node_size`` blocks (padded when nodes differ in size), so
    node ``i``'s ``j``-th rank is slot ``i * max_node_size + j``.

    >>> gather_slots(NodeLayout(((0, 2), (1,))))
    [(0, 0), (2, 1), (1, 2)]
    """
    width = layout.max_node_size
    return [(rank, i * width + j) for i, node in enumerate(layout.nodes)
            for j, rank in enumerate(node)]


def discover(group: Any, node_id: str | None, timeout_s: float) -> NodeLayout:
    """The layout of torch.distributed group ``group`` (collective over it): every rank's
    :func:`node_key` is all-gathered and equal keys are grouped. Raises ``TimeoutError`` or
    ``ConnectionError`` when a rank does not take part within ``timeout_s``."""
    mine = torch.frombuffer(bytearray(node_key(node_id)), dtype=torch.uint8)
    keys = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(keys, mine, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        err = translate_error(exc)
        if err is exc:
            raise
        raise err from exc
    return group_by_key([bytes(key.tolist()) for key in keys])


# ---------------------------------------------------------------------------- hierarchy
@dataclass(frozen=True)
class HierarchyConfig:
    """How the hierarchy is built. Every rank passes the same values except ``node_id``.

    ``node_id``: this rank's machine (ranks with equal ids share a node); None: the
    ``DISTTRAIN_NODE_ID`` environment variable, else whoever can share memory with this rank.
    ``intra_transport``: ``auto`` (shared memory when it works), ``shm`` or ``torch``.
    ``inter_algorithm``: what the leaders run among themselves, where the collective has it
    (as ``CommConfig.algorithm``: ``ring`` still broadcasts with ``auto``)."""

    node_id: str | None = None
    intra_transport: str = "auto"
    inter_algorithm: str = "auto"

    def __post_init__(self) -> None:
        if self.node_id is not None and (not isinstance(self.node_id, str) or not self.node_id):
            raise ValueError(f"node_id must be a non-empty string or None, got {self.node_id!r}")
        if self.intra_transport not in TRANSPORTS:
            raise ValueError(f"intra_transport={self.intra_transport!r} is unknown; choose one "
                             f"of: {', '.join(TRANSPORTS)}")
        if self.inter_algorithm == "hierarchical":
            raise ValueError("inter_algorithm='hierarchical' would recurse; choose a flat "
                             "algorithm such as 'ring' or 'auto'")


class LegCommunicator(Protocol):
    """What a hierarchy's legs run on: the collectives of a
    :class:`~disttrain.comm.communicator.Communicator` that the legs call."""

    transport: Transport
    stats: TrafficStats

    def reduce(self, tensor: torch.Tensor, root: int = ..., op: str | ReduceOp = ...
               ) -> Any: ...

    def all_reduce(self, tensor: torch.Tensor, op: str | ReduceOp = ...) -> Any: ...

    def broadcast(self, tensor: torch.Tensor, root: int = ...) -> Any: ...

    def gather(self, output: torch.Tensor | None, tensor: torch.Tensor, root: int = ...
               ) -> Any: ...

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> Any: ...

    def close(self) -> None: ...


# Makes a sub-communicator over a transport, its default algorithm given (the Communicator)
MakeCommunicator = Callable[[Transport, str], LegCommunicator]


@dataclass
class Hierarchy:
    """One rank's view: its node layout and the sub-communicators it belongs to."""

    layout: NodeLayout
    rank: int
    intra: LegCommunicator | None  # this node's ranks; None on a one-rank node
    inter: LegCommunicator | None  # the leaders; None on non-leaders and with one node
    config: HierarchyConfig

    @property
    def node(self) -> tuple[int, ...]:
        return self.layout.nodes[self.layout.node_of(self.rank)]

    @property
    def is_leader(self) -> bool:
        return self.layout.is_leader(self.rank)

    def traffic(self) -> dict[str, int]:
        """Bytes this rank moved inside its node and across nodes since the hierarchy was
        built (``inter_bytes_unobserved``: inside torch when the leaders run ``native``)."""
        out: dict[str, int] = {}
        for leg, comm in (("intra", self.intra), ("inter", self.inter)):
            out[f"{leg}_bytes_sent"] = 0 if comm is None else comm.stats.bytes_sent
            out[f"{leg}_bytes_recv"] = 0 if comm is None else comm.stats.bytes_recv
        inter = self.inter
        out["inter_bytes_unobserved"] = 0 if inter is None else inter.stats.bytes_unobserved
        return out

    def close(self) -> None:
        for comm in (self.intra, self.inter):
            if comm is not None:
                comm.close()


# ---------------------------------------------------------------------------- building
def build(transport: Transport, timeout_s: float, config: HierarchyConfig,
          make: MakeCommunicator, ctx: CollectiveContext | None = None) -> Hierarchy:
    """Collective over ``transport``'s ranks: find the nodes, then make this node's group
    (all nodes at once: groups are created by their members only) and the leaders' group,
    each a communicator made by ``make(transport, default_algorithm)``. ``ctx``: the
    collective that triggered the build, to name it in errors."""
    base = _torch_base(transport, timeout_s)
    layout = _discover(base, config.node_id, timeout_s, ctx)
    rank = base.rank
    node = layout.nodes[layout.node_of(rank)]
    intra = inter = None
    if len(node) > 1:
        group = base.subgroup(list(node))
        assert group is not None  # this rank is a member
        shm_config = transport.config if isinstance(transport, SharedMemoryTransport) else None
        intra = make(make_transport(config.intra_transport, group.native_group,
                                    timeout_s=timeout_s, shm_config=shm_config), "auto")
    try:
        if layout.num_nodes > 1 and layout.is_leader(rank):
            leaders = base.subgroup(list(layout.leaders))
            assert leaders is not None
            inter = make(leaders, config.inter_algorithm)
        return Hierarchy(layout, rank, intra, inter, config)
    except BaseException:
        if intra is not None:  # do not leave the node's segment and thread behind
            intra.close()
        raise


def _discover(base: TorchTransport, node_id: str | None, timeout_s: float,
              ctx: CollectiveContext | None) -> NodeLayout:
    try:
        return discover(base.native_group, node_id, timeout_s)
    except (TimeoutError, ConnectionError) as exc:
        if ctx is not None:
            raise ctx.failure("exchanging node keys", exc, None,
                              timed_out=isinstance(exc, TimeoutError)) from exc
        raise CommTimeoutError(f"build_hierarchy on rank {base.rank}: exchanging node keys "
                               f"failed within {timeout_s:g}s ({exc})",
                               op="build_hierarchy") from exc


def _torch_base(transport: Transport, timeout_s: float) -> TorchTransport:
    """A torch transport over the same ranks in the same order (sub-groups are made on it)."""
    if isinstance(transport, TorchTransport):
        return transport
    group = transport.native_group
    if group is None:
        raise ValueError(f"algorithm='hierarchical' needs a transport over a torch.distributed "
                         f"group in the group's rank order; {transport.name!r} has none here. "
                         f"Build the communicator over make_transport('torch') or 'auto'")
    return TorchTransport(group, timeout_s)


# ---------------------------------------------------------------------------- old spellings
class HierarchyOwner(Protocol):
    """What owns a hierarchy: a :class:`~disttrain.comm.communicator.Communicator`."""

    @property
    def hierarchy(self) -> Hierarchy | None: ...

    def build_hierarchy(self, config: HierarchyConfig | None = ...) -> Hierarchy: ...

    def close_hierarchy(self) -> None: ...


def build_hierarchy(comm: HierarchyOwner, config: HierarchyConfig | None = None) -> Hierarchy:
    """Deprecated spelling of ``comm.build_hierarchy(config)`` (collective)."""
    warn_once("disttrain.comm.topology.build_hierarchy(comm, config)",
              "comm.build_hierarchy(config)")
    return comm.build_hierarchy(config)


def close_hierarchy(comm: HierarchyOwner) -> None:
    """Deprecated spelling of ``comm.close_hierarchy()``."""
    warn_once("disttrain.comm.topology.close_hierarchy(comm)", "comm.close_hierarchy()")
    comm.close_hierarchy()


def hierarchy_of(comm: HierarchyOwner) -> Hierarchy | None:
    """Deprecated spelling of ``comm.hierarchy``."""
    warn_once("disttrain.comm.topology.hierarchy_of(comm)", "comm.hierarchy")
    return comm.hierarchy
