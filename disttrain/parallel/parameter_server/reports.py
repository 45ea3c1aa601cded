"""How a parameter-server run ends: what each server and worker reports, the sums over every
rank that the training loop's ``ps-*`` strategies put in their extras, and the final model.

Every surviving rank, workers and servers, leaves with the same final model and the
surviving workers' mean last loss (:func:`finish`). The survivors are every rank but the
workers the servers agreed were lost (``PSWorker.close`` and the server's report say which).
Without a loss they meet on the job's communicator; after one, on a new group of the
survivors (a collective over the job's would wait for the dead).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.parameter_server.config import PSConfig, StalenessHistogram
from disttrain.parallel.parameter_server.partition import Partition, PSRoles, scatter_flat


@dataclass(frozen=True)
class Survivors:
    """The ranks that finish the run and their communicator (rank i of ``comm`` is
    ``ranks[i]`` of the job); ``lost``: the workers' ranks the run went on without."""

    comm: Communicator
    ranks: tuple[int, ...]
    workers: tuple[int, ...]
    lost: tuple[int, ...]

    @property
    def own_comm(self) -> bool:
        """Is ``comm`` a group of its own (to close), not the job's communicator?"""
        return bool(self.lost)

    def local(self, rank: int) -> int:
        """``rank`` (of the job) on ``comm``."""
        return self.ranks.index(rank)


def survivors(comm: Communicator, roles: PSRoles, lost: Iterable[int]) -> Survivors:
    """Every surviving rank calls it with the same ``lost`` (the servers agreed on it)."""
    gone = tuple(sorted(set(lost)))
    ranks = tuple(r for r in range(roles.world_size) if r not in gone)
    workers = tuple(r for r in roles.worker_ranks if r not in gone)
    if not gone:
        return Survivors(comm, ranks, workers, gone)
    group = comm.new_group(list(ranks))
    assert group is not None  # every caller is a survivor
    return Survivors(group, ranks, workers, gone)


def finish(team: Survivors, roles: PSRoles, part: Partition, module: nn.Module, loss: float,
           own: torch.Tensor | None) -> float:
    """Every survivor, once the servers stopped: returns the surviving workers' mean last
    loss (workers give theirs, servers 0), writes each server's final values (``own`` on a
    server) into ``module``'s parameters, and gives every rank the surviving workers'
    average of each buffer (BatchNorm statistics are kept by each worker; the servers hold
    parameters only)."""
    comm = team.comm
    me = roles.role(team.ranks[comm.rank])
    buffers = list(module.buffers())
    # one small host-side vector whatever the device (the communicator stages it for NCCL)
    mine = [b.detach().double().reshape(-1).cpu() for b in buffers] if me.kind == "worker" \
        else [torch.zeros(b.numel(), dtype=torch.float64) for b in buffers]
    total = torch.cat([torch.tensor([loss], dtype=torch.float64), *mine])
    comm.all_reduce(total)
    total /= len(team.workers)
    at = 1
    with torch.no_grad():
        for b in buffers:
            mean = total[at:at + b.numel()].view_as(b)
            b.copy_(mean if b.is_floating_point() else mean.round())
            at += b.numel()
    params = [p for p in module.parameters() if p.requires_grad]
    for s, root in enumerate(roles.server_ranks):
        start, end = part.server_range(s)
        if end == start:
            continue
        if me.kind == "server" and me.index == s and own is not None:
            values = own.detach().clone()
        else:
            values = torch.empty(end - start, dtype=params[0].dtype)
        comm.broadcast(values, root=team.local(root))
        scatter_flat(params, part, start, values)
    return float(total[0])


# ----------------------------------------------------------------------
# What a parameter-server run reports: per server and per worker, returned at the end, and
# the sums over every rank that the training loop's ``ps-*`` strategies put in their extras.

@dataclass
class ServerReport:
    """What one server did: its final version and clock, the staleness of every applied
    update, requests served and rejected (by status), its bytes on the wire, and the workers
    the run went on without (``lost``: rank → how this server lost it, or which other
    server reported it)."""

    server: int
    rank: int
    mode: str
    version: int
    clock: int
    staleness: dict[int, int]
    requests: dict[str, int]
    rejected: dict[str, int]
    bytes_sent: int
    bytes_recv: int
    lost: dict[int, str] = field(default_factory=dict)  # lost worker rank → what happened

    @property
    def histogram(self) -> StalenessHistogram:
        return StalenessHistogram(self.staleness)


@dataclass
class WorkerReport:
    """One worker's run: steps, bytes on the wire (counted by comm.stats) next to what
    pushing and pulling every parameter every step would have sent, where time went, and
    the clocks a straggler experiment slowed this worker on."""

    worker: int
    rank: int
    steps: int
    bytes_sent: int
    bytes_recv: int
    dense_equivalent_bytes: int
    compute_s: float
    comm_s: float
    straggler_sleep_s: float
    slow_clocks: tuple[int, ...] = ()
    lost_workers: tuple[int, ...] = ()  # ranks of the workers the run went on without


def gather_extras(team: Survivors, roles: PSRoles, config: PSConfig, mine: list[float],
                  staleness: dict[int, int]) -> dict[str, Any]:
    """Every surviving rank: sum over them (two all-reduces) the workers' rates, bytes,
    sleeps, compute and step times and the servers' traffic and staleness histograms.
    ``mine``: rate, wire bytes/step, dense bytes/step, straggler sleep, compute s/step, server
    bytes sent, received, then one mean step time per worker (zero but in this worker's
    slot, and a lost worker's). Means are over the surviving workers."""
    comm = team.comm
    top = torch.tensor([max(staleness, default=-1)], dtype=torch.float64)
    comm.all_reduce(top, op="max")
    bins = [0.0] * (int(top) + 1)
    for k, n in staleness.items():
        bins[k] = float(n)
    sums = torch.tensor(mine + bins, dtype=torch.float64)
    comm.all_reduce(sums)
    rate, wire, dense, sleep, compute, sent, recv, *rest = sums.tolist()
    step_s, hist = rest[:roles.num_workers], rest[roles.num_workers:]
    w = len(team.workers)
    histogram = {k: int(n) for k, n in enumerate(hist) if n}
    updates = sum(histogram.values())
    return {"samples_per_s": rate, "mode": config.mode, "workers": roles.num_workers,
            "lost_workers": list(team.lost),
            "servers": roles.num_servers, "staleness_bound": config.bound,
            "worker_bytes_per_step": wire / w, "dense_bytes_per_step": dense / w,
            "straggler": {str(r): f for r, f in config.straggler.items()},
            "straggler_every": config.straggler_every,
            "straggler_sleep_s": sleep, "server_bytes_sent": sent, "server_bytes_recv": recv,
            "compute_s_per_step": compute / w, "worker_step_s": step_s,
            "staleness": {str(k): n for k, n in histogram.items()},
            "staleness_mean": sum(k * n for k, n in histogram.items()) / updates
            if updates else 0.0, "staleness_max": max(histogram, default=0)}
