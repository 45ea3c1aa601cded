"""Hybrid sharding (FSDP2's HSDP, DeepSpeed's MiCS and hpZ): shard inside groups of S ranks,
replicate across the R groups; S × R = the data-parallel size N.

Plain ZeRO shards over all N ranks, so every all-gather and reduce-scatter spans the whole
job, across the slow links between nodes. Hybrid sharding keeps them inside a shard group
(one node: S = its GPUs) and sends only the reduced gradient *shard* across groups, once per
reduction, by an all-reduce among the R ranks that hold the same shard::

    mesh dp_replicate × dp_shard = 2 × 2       rank = replicate · S + shard
    shard groups (dp_shard):      {0, 1} {2, 3}       reduce-scatter, all-gather  (S)
    replicate groups (dp_replicate): {0, 2} {1, 3}    all-reduce of the shard     (R)

    backward   reduce_scatter(grads) over S ─▶ all_reduce(shard, avg) over R   (per micro-batch)
    step       each rank updates its shard (the replicas update identical shards)
    gather     all_gather over S (stage 3: before each unit; stages 1 and 2: after the step)

Averages compose: the mean over S of each replica, then the mean over R, is the mean over
all N ranks, so a hybrid run equals plain ZeRO and one process on the global batch. What
each rank holds is what ZeRO on S ranks holds (:func:`~.memory.formula` with
``dp_shard=S``); what it sends per step is below (:func:`step_bytes`), on two
communicators whose counters are kept apart. Give a wrapper the shard group as its
communicator and the replicate group as ``replicate=`` (:func:`zero_groups` reads both
from a mesh). Checkpoints are written by the first replica only: the others hold the same
shards (:func:`~.checkpoint.save`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disttrain.comm import Communicator
from disttrain.parallel.mesh import DeviceMesh, check_agreement
from disttrain.parallel.zero.sharding import ZeroConfig, ZeroWrapper


def zero_groups(mesh: DeviceMesh) -> tuple[Communicator, Communicator | None]:
    """(shard group, replicate group) of ``mesh`` for a ZeRO wrapper: hybrid when both
    dp_shard and dp_replicate have more than one rank; otherwise plain ZeRO over all of dp
    (``replicate`` None)."""
    shard, replicate = mesh.group("dp_shard"), mesh.group("dp_replicate")
    if shard is not None and replicate is not None:
        return shard, replicate
    dp = mesh.group("dp")
    if dp is None:
        raise ValueError("ZeRO shards over the data-parallel ranks, and this mesh has one; "
                         "give --dp (or --dp-shard) at least 2 ranks")
    return dp, None


def check_groups(comm: Communicator, replicate: Communicator | None) -> None:
    """Raise unless ``replicate`` groups the ranks that hold the same shard: its members
    must have one rank and one size in their shard groups (groups swapped or built from
    different meshes would pair different shards)."""
    if replicate is None:
        return
    if replicate is comm:
        raise ValueError("replicate= is the shard group itself; pass the dp_replicate group "
                         "(zero_groups(mesh) returns both)")
    check_agreement(replicate, [comm.rank, comm.world_size], "the shard-group rank and size "
                    "within a replicate group", fix="replicate= must join the ranks at the "
                    "same place of their shard groups (mesh.group('dp_replicate'))")


def broadcast_initial(tensor: torch.Tensor, config: ZeroConfig, comm: Communicator,
                      replicate: Communicator | None) -> None:
    """Global rank 0's values everywhere (``config.broadcast_from_rank0``): from shard rank
    0 over each shard group, then from the first replica over each replicate group."""
    if not config.broadcast_from_rank0:
        return
    for group in (comm, replicate):
        if group is not None and group.world_size > 1:
            group.broadcast(tensor, 0, algorithm=config.algorithm_for("broadcast"))


# ----------------------------------------------------------------------
# Bytes per step: each communicator's own figure, so the intra-group links (NVLink, shared
# memory) and the inter-group ones (the network) are accounted separately.

@dataclass(frozen=True)
class StepBytes:
    """Bytes one rank sends per optimizer step: ``intra`` in its shard group (reduce-scatter
    and all-gathers), ``inter`` in its replicate group (all-reduce of the gradient shard)."""

    intra: float
    inter: float

    @property
    def total(self) -> float:
        return self.intra + self.inter


def _counts(stage: int, accumulate: int) -> tuple[int, int]:
    """(reductions, gathers) per step: stage 1 reduces once at the step; stages 2 and 3 once
    per micro-batch; stage 3 gathers twice per micro-batch (forward, backward)."""
    if stage == 1:
        return 1, 1
    return accumulate, (1 if stage == 2 else 2 * accumulate)


def step_bytes(zero: ZeroWrapper, accumulate: int = 1) -> StepBytes:
    """What ``zero``'s rank sends per step with ``accumulate`` micro-batches, by the
    algorithm each communicator runs for each collective of each flat group (``native``,
    whose bytes torch does not show: the ring's figure)."""
    reductions, gathers = _counts(zero.stage, accumulate)
    red = torch.empty(0, dtype=zero.reduce_dtype).element_size()
    par = torch.empty(0, dtype=zero.param_dtype).element_size()
    config, intra, inter = zero.config, 0.0, 0.0
    for group in zero.shard_groups():
        padded = group.layout.padded_total
        intra += reductions * _sent(zero.comm, "reduce_scatter", padded * red, config.algorithm)
        intra += gathers * _sent(zero.comm, "all_gather", padded * par, config.algorithm)
        if zero.replicate is not None:
            inter += reductions * _sent(zero.replicate, "all_reduce",
                                        group.layout.shard_size * red,
                                        config.algorithm_for("all_reduce"))
    return StepBytes(intra, inter)


def _sent(comm: Communicator, op: str, nbytes: int, algorithm: str | None) -> float:
    theory = comm.theory_bytes_sent(op, nbytes, algorithm)
    if theory is not None:
        return theory
    n = comm.world_size
    return (2 if op == "all_reduce" else 1) * (n - 1) / n * nbytes


def ring_step_bytes(stage: int, padded: int, dp_shard: int, dp_replicate: int = 1, *,
                    param_bytes: int, reduce_bytes: int, accumulate: int = 1) -> StepBytes:
    """The same figure for ring algorithms, from sizes alone (the simulator's and the
    docs'): ``padded`` elements sharded over S = ``dp_shard`` ranks, R = ``dp_replicate``
    replicas. A ring moves (S−1)/S of the buffer per reduce-scatter or all-gather and
    2(R−1)/R of the shard (padded/S) per all-reduce."""
    for name, value in (("dp_shard", dp_shard), ("dp_replicate", dp_replicate),
                        ("accumulate", accumulate)):
        if value < 1:
            raise ValueError(f"{name} must be ≥ 1, got {value}")
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    reductions, gathers = _counts(stage, accumulate)
    s, r = dp_shard, dp_replicate
    intra = (s - 1) / s * padded * (reductions * reduce_bytes + gathers * param_bytes)
    inter = reductions * 2 * (r - 1) / r * padded / s * reduce_bytes
    return StepBytes(intra, inter)
