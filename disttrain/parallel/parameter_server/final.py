"""The end of a parameter-server run in the training loop: every surviving rank, workers and
servers, leaves with the same final model and the surviving workers' mean last loss.

The survivors are every rank but the workers the servers agreed were lost (``PSWorker.close``
and the server's report say which). Without a loss they meet on the job's communicator; after
one, on a new group of the survivors (a collective over the job's would wait for the dead).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.parameter_server.flat import scatter_flat
from disttrain.parallel.parameter_server.partition import Partition
from disttrain.parallel.parameter_server.roles import PSRoles


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
