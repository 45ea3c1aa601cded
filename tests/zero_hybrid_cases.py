"""Rank functions for hybrid sharding (shard inside groups of S, replicate across R) on a
dp_replicate × dp_shard mesh; the single-process references in float64 (runs inside ranks too)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel import zero
from disttrain.parallel.mesh import MeshShape, build_mesh
from disttrain.parallel.zero import ZeroConfig, checkpoint
from tests import zero_cases

F64 = torch.float64
RING = ZeroConfig(algorithm="ring", bucket_bytes=512)  # ring: every byte is counted


def reference(optimizer: str, steps: int) -> dict[str, torch.Tensor]:
    """One float64 process on the global batch."""
    model = zero_cases.make_net(F64)
    opt = zero_cases.OPTIMIZERS[optimizer](model.parameters())
    for step in range(steps):
        x, y = zero_cases.batch(step, F64)
        opt.zero_grad()
        zero_cases.loss_fn(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def mesh_of(comm: Communicator, replicas: int, shards: int) -> Any:
    """A fresh world communicator (closed by the caller) split into R × S."""
    world = comm.new_group(list(range(comm.world_size)))
    assert world is not None
    return build_mesh(world, MeshShape(dp_replicate=replicas, dp_shard=shards))


def train(z: Any, dp_rank: int, dp_size: int, first: int, last: int, micro: int = 1) -> None:
    forward = z if z.stage == 3 else z.module
    for step in range(first, last):
        x, y = zero_cases.local_batch(step, dp_rank, dp_size, F64)
        z.zero_grad()
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            (zero_cases.loss_fn(forward(xs), ys) / micro).backward()
        z.step()


def wrap(stage: int, mesh: Any, optimizer: str, config: ZeroConfig = RING,
         dtype: torch.dtype = F64) -> Any:
    shard, replicate = zero.zero_groups(mesh)
    return zero.STAGES[stage](zero_cases.make_net(dtype), shard,
                              zero_cases.OPTIMIZERS[optimizer], config, replicate=replicate)


def sent(comm: Communicator) -> int:
    return comm.stats.bytes_sent


def run_equivalence(comm: Communicator, stage: int, optimizer: str, steps: int,
                    micro: int) -> dict[str, Any]:
    """R = S = 2: parameters after ``steps``, and per communicator the bytes sent in those
    steps beside the wrapper's figure and the ring formula's."""
    mesh = mesh_of(comm, 2, 2)
    try:
        z = wrap(stage, mesh, optimizer)
        before = sent(z.comm), sent(z.replicate)
        train(z, mesh.dp_rank, mesh.dp_size, 0, steps, micro)
        measured = ((sent(z.comm) - before[0]) / steps, (sent(z.replicate) - before[1]) / steps)
        theory = zero.step_bytes(z, micro)
        padded = sum(g.layout.padded_total for g in z.shard_groups())
        ring = zero.ring_step_bytes(stage, padded, 2, 2, param_bytes=8, reduce_bytes=8,
                                    accumulate=micro)
        return {"params": zero_cases.full_params(z),  # (gathers: after the count)
                "intra": measured[0], "inter": measured[1],
                "theory": (theory.intra, theory.inter), "ring": (ring.intra, ring.inter),
                "groups": (z.comm.global_ranks, z.replicate.global_ranks)}
    finally:
        mesh.world.close()


def run_memory(comm: Communicator, stage: int) -> dict[str, Any]:
    """A ~33k-parameter MLP in fp32 with Adam, one step, 2 × 2: what a rank holds, measured
    and by the formula (shards over S = 2, not over all 4 ranks)."""
    mesh = mesh_of(comm, 2, 2)
    try:
        shard, replicate = zero.zero_groups(mesh)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
        z = zero.STAGES[stage](model, shard, functools.partial(torch.optim.Adam, lr=1e-3),
                               replicate=replicate)
        forward = z if stage == 3 else z.module
        forward(torch.randn(4, 64)).square().mean().backward()
        z.step()
        return {"measured": zero.zero_measured(z).as_dict(),
                "formula": zero.zero_formula(z).as_dict(), "numel": z.numel}
    finally:
        mesh.world.close()


def run_save(comm: Communicator, stage: int, optimizer: str, steps: int,
             directory: str) -> int:
    """Train and save 2 × 2; how many shard files this rank wrote."""
    mesh = mesh_of(comm, 2, 2)
    written = []
    write = checkpoint.write_shard
    checkpoint.write_shard = lambda *args: written.append(write(*args))  # type: ignore
    try:
        z = wrap(stage, mesh, optimizer)
        train(z, mesh.dp_rank, mesh.dp_size, 0, steps)
        zero.save(z, directory)
        return len(written)
    finally:
        checkpoint.write_shard = write
        mesh.world.close()


def run_resume(comm: Communicator, stage: int, optimizer: str, first: int, last: int,
               directory: str, replicas: int) -> dict[str, torch.Tensor]:
    """Fresh random parameters everywhere, then the checkpoint, then steps first..last−1 on
    ``replicas`` × (world / replicas) (1: plain ZeRO over every rank)."""
    torch.manual_seed(1234 + comm.rank)  # load must win over these
    config = ZeroConfig(algorithm="ring", broadcast_from_rank0=False)
    model = zero_cases.Net().to(F64)
    if replicas == 1:
        z = zero.STAGES[stage](model, comm, zero_cases.OPTIMIZERS[optimizer], config)
        zero.load(z, directory)
        train(z, comm.rank, comm.world_size, first, last)
        return zero_cases.full_params(z)
    mesh = mesh_of(comm, replicas, comm.world_size // replicas)
    try:
        shard, replicate = zero.zero_groups(mesh)
        z = zero.STAGES[stage](model, shard, zero_cases.OPTIMIZERS[optimizer], config,
                               replicate=replicate)
        zero.load(z, directory)
        train(z, mesh.dp_rank, mesh.dp_size, first, last)
        return zero_cases.full_params(z)
    finally:
        mesh.world.close()
