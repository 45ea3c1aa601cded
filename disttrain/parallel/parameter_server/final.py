"""The end of a parameter-server run in the training loop: every rank, workers and servers,
leaves with the same final model and the workers' mean last loss."""

from __future__ import annotations

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.parameter_server.flat import scatter_flat
from disttrain.parallel.parameter_server.partition import Partition
from disttrain.parallel.parameter_server.roles import PSRoles


def finish(comm: Communicator, roles: PSRoles, part: Partition, module: nn.Module,
           loss: float, own: torch.Tensor | None) -> float:
    """Every rank, once the servers stopped: returns the workers' mean last loss (workers
    give theirs, servers 0), writes each server's final values (``own`` on a server) into
    ``module``'s parameters, and gives every rank the workers' average of each buffer
    (BatchNorm statistics are kept by each worker; the servers hold parameters only)."""
    me = roles.role(comm.rank)
    buffers = list(module.buffers())
    # one small host-side vector whatever the device (the communicator stages it for NCCL)
    mine = [b.detach().double().reshape(-1).cpu() for b in buffers] if me.kind == "worker" \
        else [torch.zeros(b.numel(), dtype=torch.float64) for b in buffers]
    total = torch.cat([torch.tensor([loss], dtype=torch.float64), *mine])
    comm.all_reduce(total)
    total /= roles.num_workers
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
        comm.broadcast(values, root=root)
        scatter_flat(params, part, start, values)
    return float(total[0])
