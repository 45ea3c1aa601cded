"""The reference and disttrain's data parallelism: ``single`` and ``ddp``.

``single`` is one process: forward, backward, update, the reference every other strategy
must match. ``ddp`` wraps the model in :class:`disttrain.parallel.DataParallel`: gradients are
averaged over the ranks in buckets during backward, so each replica takes the same step as
one process on the whole global batch.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from statistics import mean
from typing import Any

import torch

from disttrain.comm import Communicator
from disttrain.train.strategies.base import (
    BuildContext,
    Stepper,
    Strategy,
    param_bytes,
    ring_all_reduce_bytes,
)


def build_single(ctx: BuildContext) -> Strategy:
    strategy = Strategy(ctx.module, ctx.make_optimizer(ctx.module.parameters()), ctx.comm)
    strategy.zero_stage = 0  # one replica: the replicated formula with N = 1
    return strategy


class DataParallelStrategy(Strategy):
    """A DDP-style wrapper: gradients averaged over ranks during backward, ``no_sync`` for
    accumulation. Theory: one all-reduce of every gradient per step, 2(p−1)/p·4Ψ bytes per
    rank with a bandwidth-optimal algorithm (ring; halving-doubling on a power of two), 4Ψ
    with ``shm`` (each rank writes its gradients once)."""

    zero_stage = 0

    def __init__(self, ctx: BuildContext, model: Any, optimizer: Stepper | None = None, *,
                 comm: Communicator | None = None) -> None:
        comm = comm if comm is not None else ctx.require_comm(ctx.config.strategy)
        if optimizer is None:
            optimizer = ctx.make_optimizer(ctx.module.parameters())
        super().__init__(ctx.module, optimizer, comm, model)
        if ctx.config.parallel.compression is None:
            self.theory_bytes_per_step = self._theory(comm, ctx.config.parallel.algorithm)
        self._overlap: list[tuple[float, float, float]] = []  # comm_s, exposed_s, hidden

    def _theory(self, comm: Communicator, algorithm: str | None) -> float:
        """One all-reduce of every bucket, at the bytes of the algorithm the communicator
        runs for each (a ring's 2(p−1)/p of it when that is None: ``native``, or torch's own
        DDP, whose buckets are not known here)."""
        buckets = getattr(self.model, "buckets", None)
        if not isinstance(buckets, list):
            return ring_all_reduce_bytes(comm.world_size, param_bytes(self.module))
        total = 0.0
        for bucket in buckets:
            theory = comm.theory_bytes_sent("all_reduce", bucket.nbytes, algorithm)
            total += ring_all_reduce_bytes(comm.world_size, bucket.nbytes) if theory is None \
                else theory
        return total + self._buffer_theory(comm)

    def _buffer_theory(self, comm: Communicator) -> float:
        """Before each synced forward DDP re-broadcasts the module's buffers (BatchNorm's
        running statistics) from rank 0, one broadcast per dtype; rank 0 sends the most."""
        config = getattr(self.model, "config", None)
        if comm.world_size == 1 or not getattr(config, "broadcast_buffers", False):
            return 0.0
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for b in self.module.buffers():
            if b.numel():
                key = (b.dtype, b.device)
                sizes[key] = sizes.get(key, 0) + b.numel() * b.element_size()
        total = 0.0
        for nbytes in sizes.values():
            theory = comm.theory_bytes_sent("broadcast", nbytes)
            total += float(nbytes) if theory is None else theory
        return total

    def no_sync(self) -> AbstractContextManager[Any]:
        return self.model.no_sync()  # type: ignore[operator, no-any-return]

    def after_step(self) -> None:
        report = getattr(self.model, "last_overlap", None)
        if report is not None:
            r = report()
            self._overlap.append((r.comm_s, r.exposed_s, r.hidden_fraction))

    def extras(self, warmup_steps: int) -> dict[str, Any]:
        timed = self._overlap[warmup_steps:] or self._overlap
        if not timed:
            return {}
        return {"comm_s_per_step": mean(t[0] for t in timed),
                "exposed_comm_s_per_step": mean(t[1] for t in timed),
                "overlap_fraction": mean(t[2] for t in timed)}


def build_ddp(ctx: BuildContext, comm: Communicator | None = None) -> Strategy:
    """DDP of the whole module over ``comm`` (the data-parallel ranks; default: all)."""
    from disttrain.parallel import DataParallel

    opts = ctx.config.parallel
    comm = comm if comm is not None else ctx.require_comm(ctx.config.strategy)
    model = DataParallel(ctx.module, comm, bucket_cap_mb=opts.bucket_cap_mb,
                         find_unused_parameters=opts.find_unused_parameters,
                         broadcast_buffers=opts.broadcast_buffers, compression=opts.compression,
                         algorithm=opts.algorithm)
    return DataParallelStrategy(ctx, model, comm=comm)
