"""PyTorch's own implementations, run through the same loop as baselines: ``torch-ddp`` and
``torch-zero1`` (``torch-gpipe`` is in :mod:`.torch_pipeline`).

These are torch's code, so they call torch.distributed directly, on the process group under
the communicator's ``torch`` transport; their traffic bypasses disttrain.comm and is not
counted (``counts_bytes = False``). The theoretical bytes are given for comparison.

Teardown matters: torch's DDP on Gloo aborted at exit in 7 of 30 two-rank runs ("terminate
called without an active exception", shared/research/baseline.md) unless the DDP model was
deleted and garbage-collected before ``destroy_process_group``. ``close()`` drops every
wrapper and collects, so a baseline never makes the benchmark table flaky.
"""

from __future__ import annotations

import gc
import os
from typing import Any

from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.checkpoint_files import atomic_save
from disttrain.parallel.checkpoint_files import load as safe_load
from disttrain.train.strategies.base import (
    BuildContext,
    Strategy,
    missing_state,
    optimizer_class,
    param_bytes,
    ring_all_reduce_bytes,
)
from disttrain.train.strategies.data_parallel import DataParallelStrategy


def native_group(comm: Communicator, name: str) -> Any:
    group = comm.transport.native_group
    if group is None:
        raise ValueError(f"strategy {name!r} needs a torch.distributed process group; use "
                         f"the 'torch' transport")
    return group


def torch_ddp(ctx: BuildContext, name: str) -> nn.Module:
    """torch's DistributedDataParallel around the module, with the loop's bucket settings."""
    comm = ctx.require_comm(name)
    group = native_group(comm, name)
    comm.expect_workload("collectives")  # as disttrain's DDP: the same I/O-thread policy
    opts = ctx.config.parallel
    # torch ≥ 2.13 warns that broadcast_buffers is deprecated; True is its default anyway
    extra: dict[str, Any] = {} if opts.broadcast_buffers else {"broadcast_buffers": False}
    return nn.parallel.DistributedDataParallel(
        ctx.module, process_group=group, bucket_cap_mb=opts.bucket_cap_mb,
        find_unused_parameters=opts.find_unused_parameters, **extra)


class TorchDDPStrategy(DataParallelStrategy):
    """torch's DistributedDataParallel: its traffic bypasses disttrain.comm's counters."""

    counts_bytes = False

    def close(self) -> None:
        self.model = self.module  # drop DDP's reducer before the process group goes
        gc.collect()


def build_torch_ddp(ctx: BuildContext) -> Strategy:
    return TorchDDPStrategy(ctx, torch_ddp(ctx, "torch-ddp"))


class TorchZeroStrategy(TorchDDPStrategy):
    """torch's ZeroRedundancyOptimizer (wrapping the configured optimizer class) under torch's
    DDP, as the DistributedTest benchmark ran it: DDP all-reduces every gradient, then each
    rank updates the parameters it owns and broadcasts them. Theory per rank: the all-reduce,
    2(p−1)/p·4Ψ, plus on average (p−1)/p·4Ψ of broadcasts (each rank sends its ~Ψ/p
    parameters to p−1 peers; ZeRO assigns whole tensors, so ranks differ)."""

    def __init__(self, ctx: BuildContext) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        group = native_group(ctx.require_comm("torch-zero1"), "torch-zero1")
        model = torch_ddp(ctx, "torch-zero1")
        cls, kwargs = optimizer_class(ctx.config)
        optimizer = ZeroRedundancyOptimizer(ctx.module.parameters(), optimizer_class=cls,
                                            process_group=group, **kwargs)
        super().__init__(ctx, model, optimizer)
        p, psi = group.size(), param_bytes(ctx.module)
        self.theory_bytes_per_step = ring_all_reduce_bytes(p, psi) + (p - 1) / p * psi

    def save_state(self, path: str, rank: int) -> None:
        """Consolidate the optimizer shards on rank 0 (torch's way; a collective), save there."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        assert isinstance(self.optimizer, ZeroRedundancyOptimizer)
        self.optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            atomic_save({"model": self.module.state_dict(),
                         "optimizer": self.optimizer.state_dict()},
                        os.path.join(path, "state.pt"))

    def load_state(self, path: str, rank: int) -> None:
        file = os.path.join(path, "state.pt")
        if not os.path.exists(file):
            raise missing_state(path, "state.pt")
        self.load_state_dict(safe_load(file))  # each rank keeps its partition of the state

    def close(self) -> None:
        self.optimizer = None
        super().close()


def build_torch_zero1(ctx: BuildContext) -> Strategy:
    return TorchZeroStrategy(ctx)
