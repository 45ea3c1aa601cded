"""Collective times on a cluster: the cost model's formulas, placed on two network levels.

A *group* is ``size`` devices, ``per_node`` of them on each node they span (ranks are
contiguous, so a data-parallel group of 64 on 8-GPU nodes has 8 per node; the stage-0
group of a 4-stage pipeline grid has 2 per node). Algorithms:

* ``ring``, ``tree``, ``halving_doubling``: flat, as in :mod:`disttrain.comm.cost_model`.
  A flat ring that spans nodes runs at its slowest hop: α of the inter-node link and the
  larger of the two β (one ring crosses each NIC once per direction). A binomial tree pays
  the intra-node link for its first ⌈log₂ per_node⌉ rounds and the NIC for the others (one
  flow per NIC). Recursive halving/doubling pays the NIC for its steps at distance ≥
  per_node, where every device of a node crosses it at once (per_node flows share it);
  its fold step (p not a power of two) pairs neighbouring ranks, on one node unless a node
  boundary falls between them. reduce_scatter and all_gather have no tree: asked for one,
  they use the fastest algorithm they have.
* ``hierarchical`` (all_reduce across nodes; Horovod's and NCCL's two-level scheme; other
  ops, or one node: a ring, which already stays hop-local)::

      reduce_scatter inside each node  (ring over per_node devices, N bytes)
      all_reduce across nodes          (per_node rings in parallel, N/per_node each,
                                        sharing the NIC)
      all_gather inside each node      (ring over per_node devices)

* ``auto``: the fastest of those, as ``algorithm="auto"`` chooses.

``flows`` is how many groups use a node's NIC at the same time (the stage groups of a
pipeline grid); their streams share its bandwidth. :func:`ring_all_reduce_tasks` and
:func:`tree_all_reduce_tasks` expand a collective into per-step tasks of the event engine;
tests check that they reproduce the closed forms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from disttrain.comm.cost_model import LinkCosts, predict, theory_bytes_sent
from disttrain.simulate.cluster import Cluster
from disttrain.simulate.events import Simulation

ALGORITHMS = ("auto", "ring", "tree", "halving_doubling", "hierarchical")
_FLAT = {"all_reduce": ("ring", "tree", "halving_doubling"),
         "reduce_scatter": ("ring", "halving_doubling"),
         "all_gather": ("ring", "halving_doubling")}


@dataclass(frozen=True)
class Group:
    """``size`` devices, ``per_node`` per node, ``flows`` groups sharing each NIC."""

    size: int
    per_node: int
    flows: int = 1

    @property
    def nodes(self) -> int:
        return -(-self.size // self.per_node)


def group_of(cluster: Cluster, size: int, stride: int = 1) -> Group:
    """The group of ``size`` devices whose ranks are ``stride`` apart (contiguous ranks:
    stride 1; the copies of one pipeline stage: stride pp_size)."""
    dpn = cluster.devices_per_node
    per_node = max(1, min(size, dpn // stride)) if stride <= dpn else 1
    flows = min(stride, dpn)
    return Group(size, per_node, flows)


def _bottleneck(cluster: Cluster, group: Group) -> LinkCosts:
    """Costs of a flat algorithm: the intra link inside one node, else its slowest hop."""
    intra = cluster.intra_link()
    if group.nodes == 1:
        return intra
    inter = cluster.inter_link(group.flows)
    return LinkCosts(alpha=max(intra.alpha, inter.alpha), beta=max(intra.bx, inter.beta),
                     gamma=intra.gamma, alpha_exchange=max(intra.ax, inter.alpha),
                     beta_exchange=max(intra.bx, inter.beta), chunk_bytes=intra.chunk_bytes,
                     source="bottleneck")


def _tree(cluster: Cluster, group: Group, nbytes: float) -> float:
    lg = math.ceil(math.log2(group.size)) if group.size > 1 else 0
    inside = min(lg, math.ceil(math.log2(group.per_node)) if group.per_node > 1 else 0)
    a, b = cluster.intra_link(), cluster.inter_link(group.flows)
    step_in, step_out = a.alpha + nbytes * a.beta, b.alpha + nbytes * b.beta
    return 2 * (inside * step_in + (lg - inside) * step_out) + lg * nbytes * a.gamma


def _halving_doubling(cluster: Cluster, group: Group, op: str, nbytes: float) -> float:
    """Rabenseifner across nodes: a step at distance d ≥ per_node crosses the NIC, and then
    every device of the node crosses it at once (per_node flows), unlike a ring's one."""
    q = 1 << (group.size.bit_length() - 1)
    levels = q.bit_length() - 1
    intra, inter = cluster.intra_link(), cluster.inter_link(group.flows * group.per_node)
    total = 0.0
    for j in range(1, levels + 1):
        c = inter if q >> j >= group.per_node else intra
        a, b, chunk = (c.ax, c.bx, nbytes / (1 << j)) if c is intra else (
            c.alpha, c.beta, nbytes / (1 << j))
        rounds = 2 if op == "all_reduce" else 1
        total += rounds * (a + chunk * b) + (0 if op == "all_gather" else chunk * c.gamma)
    if q != group.size:  # fold the extra ranks into their neighbours (fold_map)
        small = nbytes / group.size
        fold = cluster.inter_link(group.flows) if _fold_crosses(group, q) else intra
        a, b, g = fold.alpha, fold.beta, intra.gamma
        total += {"all_reduce": 2 * (a + nbytes * b) + nbytes * g,
                  "reduce_scatter": 2 * a + (nbytes + small) * b + nbytes * g,
                  "all_gather": 2 * a + (small + nbytes) * b}[op]
    return total


def _fold_crosses(group: Group, q: int) -> bool:
    """Whether a fold pair spans two nodes. :func:`~disttrain.comm.algorithms.chunking.
    fold_map` pairs ranks 2v and 2v+1 for v < p − q: on one node unless a node boundary
    falls between them, i.e. 2v+1 is a multiple of per_node, which happens only for an odd
    per_node ≤ 2(p − q) − 1 (per_node 1: every pair)."""
    k = group.per_node
    return k % 2 == 1 and k <= 2 * (group.size - q) - 1


def _hierarchical(cluster: Cluster, group: Group, nbytes: float) -> float:
    k, n = group.per_node, group.nodes
    intra = cluster.intra_link()
    inter = cluster.inter_link(group.flows * k)
    return (predict("reduce_scatter", "ring", k, int(nbytes), intra)
            + predict("all_reduce", "ring", n, int(nbytes / k), inter)
            + predict("all_gather", "ring", k, int(nbytes), intra))


def collective_time(cluster: Cluster, op: str, algorithm: str, group: Group,
                    nbytes: float) -> tuple[float, str]:
    """(seconds, algorithm used) for one ``op`` of ``nbytes`` (nccl-tests size)."""
    if op not in _FLAT:
        raise ValueError(f"op must be one of {', '.join(_FLAT)}, got {op!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if group.size <= 1 or nbytes <= 0:
        return 0.0, "none"
    candidates = (*_FLAT[op], "hierarchical") if op == "all_reduce" and group.nodes > 1 \
        else _FLAT[op]
    if algorithm == "hierarchical" and (op != "all_reduce" or group.nodes == 1):
        candidates = ("ring",)  # a ring already stays hop-local; on one node: a flat ring
    elif algorithm in _FLAT[op] or algorithm == "hierarchical":
        candidates = (algorithm,)
    elif algorithm != "auto":  # tree has no reduce-scatter/all-gather: the best that exists
        candidates = _FLAT[op]
    best = (math.inf, "none")
    for name in candidates:
        if name == "hierarchical":
            t = _hierarchical(cluster, group, nbytes)
        elif name == "tree" and group.nodes > 1:
            t = _tree(cluster, group, nbytes)
        elif name == "halving_doubling" and group.nodes > 1:
            t = _halving_doubling(cluster, group, op, nbytes)
        else:
            t = predict(op, name, group.size, int(nbytes), _bottleneck(cluster, group))
        best = min(best, (t, name))
    return best


def bytes_sent(op: str, algorithm: str, group: Group, nbytes: float) -> float:
    """Bytes the busiest device sends for one collective (the cost model's table)."""
    if group.size <= 1 or algorithm == "none":
        return 0.0
    if algorithm == "hierarchical":
        k = group.per_node
        return (2 * (k - 1) / k * nbytes
                + (theory_bytes_sent("all_reduce", "ring", group.nodes, int(nbytes / k)) or 0))
    return theory_bytes_sent(op, algorithm, group.size, int(nbytes)) or 0.0


# ---------------------------------------------------------------------------- expansions
def ring_all_reduce_tasks(sim: Simulation, link: str, compute: str, p: int, nbytes: float,
                          costs: LinkCosts, deps: tuple[int, ...] = ()) -> int:
    """One rank's view of a ring all-reduce (Thakur et al.), step by step: p−1
    reduce-scatter steps (send N/p, receive N/p, reduce it, unstreamed), then p−1
    all-gather steps. Every rank does the same, so one rank's chain is the collective's
    time: 2(p−1)α + 2(p−1)/p·Nβ + (p−1)/p·Nγ. Returns the last task."""
    chunk, last = nbytes / p, deps
    for step in range(p - 1):
        send = sim.add(f"rs{step}", link, costs.ax + chunk * costs.bx, last, "comm")
        last = (sim.add(f"reduce{step}", compute, chunk * costs.gamma, (send,), "reduce"),)
    for step in range(p - 1):
        last = (sim.add(f"ag{step}", link, costs.ax + chunk * costs.bx, last, "comm"),)
    return last[0]


def tree_all_reduce_tasks(sim: Simulation, link: str, compute: str, p: int, nbytes: float,
                          costs: LinkCosts, deps: tuple[int, ...] = ()) -> int:
    """The root's view of a binomial-tree all-reduce: L = ⌈log₂ p⌉ rounds of receiving N
    and reducing it, then L rounds of sending N: 2L(α + Nβ) + L·Nγ."""
    rounds = math.ceil(math.log2(p)) if p > 1 else 0
    last = deps
    for r in range(rounds):
        recv = sim.add(f"up{r}", link, costs.alpha + nbytes * costs.beta, last, "comm")
        last = (sim.add(f"reduce{r}", compute, nbytes * costs.gamma, (recv,), "reduce"),)
    for r in range(rounds):
        last = (sim.add(f"down{r}", link, costs.alpha + nbytes * costs.beta, last, "comm"),)
    return last[0] if last else sim.add("noop", link, 0.0, deps)


def thakur_ring(p: int, nbytes: float, alpha: float, beta: float, gamma: float) -> float:
    """Thakur et al.'s ring all-reduce: 2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta + (p - 1) / p * nbytes * gamma


def unstreamed(costs: LinkCosts) -> LinkCosts:
    """``costs`` with a ring sub-chunk so large that nothing is streamed (Thakur's form)."""
    return replace(costs, chunk_bytes=1 << 62, by_world_size=())
