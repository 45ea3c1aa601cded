"""PyTorch's own implementations, run through the same loop as baselines: ``torch-ddp``,
``torch-zero1`` and ``torch-fsdp`` (``torch-gpipe`` is in :mod:`.torch_pipeline`, DeepSpeed's
rows in :mod:`.deepspeed_baseline`).

These are torch's code, so they call torch.distributed directly, on the process group under
the communicator's ``torch`` transport; their traffic bypasses disttrain.comm and is not
counted (``counts_bytes = False``). The theoretical bytes are given for comparison.

Teardown matters: torch's DDP on Gloo aborted at exit in 7 of 30 two-rank runs ("terminate
called without an active exception", shared/research/baseline.md) unless the DDP model was
deleted and garbage-collected before ``destroy_process_group``. ``close()`` drops every
wrapper and collects, so a baseline never makes the benchmark table flaky.
"""

from __future__ import annotations

import copy
import gc
import os
from typing import Any

import torch
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


def empty_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s structure with empty tensors: the plain module a sharding
    baseline fills with the gathered values after training (it costs no memory before)."""
    skeleton = copy.deepcopy(module)
    for tensor in [*skeleton.parameters(), *skeleton.buffers()]:
        tensor.data = torch.empty(0, dtype=tensor.dtype)
    return skeleton


def native_group(comm: Communicator, name: str) -> Any:
    group = comm.transport.native_group
    if group is None:
        raise ValueError(f"strategy {name!r} needs a torch.distributed process group; use "
                         f"the 'torch' transport")
    return group


def mesh_device_type(ctx: BuildContext, comm: Communicator, name: str) -> str:
    """The device type of torch's DeviceMesh for baseline ``name``: where the module lives.
    torch's own collectives move its tensors where they are, which disttrain cannot stage:
    a module on a device the backend cannot serve (CUDA tensors on Gloo, which cannot
    reduce-scatter them) is refused in one line."""
    param = next(ctx.module.parameters(), None)
    device = param.device.type if param is not None else "cpu"
    if device != comm.transport.device_type:
        backend = "nccl" if device == "cuda" else "gloo"
        raise ValueError(f"strategy {name!r} runs torch's own collectives on the module's "
                         f"{device} tensors, which the {comm.transport.device_type} backend "
                         f"cannot move and disttrain cannot stage for it; use --backend "
                         f"{backend} with --device {device}")
    return device


def torch_ddp(ctx: BuildContext, name: str) -> nn.Module:
    """torch's DistributedDataParallel around the module, with the loop's bucket settings."""
    comm = ctx.require_comm(name)
    group = native_group(comm, name)
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

    zero_stage = 1

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The module's parameters and gradients, and the local optimizer over the
        parameters this rank owns (``ZeroRedundancyOptimizer.optim``)."""
        from disttrain.train.memory import optimizer_tensors

        params: list[torch.Tensor] = list(self.module.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": optimizer_tensors(getattr(self.optimizer, "optim", None))}

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


class TorchFSDPStrategy(Strategy):
    """torch's FSDP2 (``fully_shard``): ZeRO stage 3 as PyTorch ships it, on a DeviceMesh
    of the module's device type over the communicator's group. Each child module with
    parameters is one unit (as disttrain's ``zero3`` cuts a Sequential), then the root: a
    unit's parameters are all-gathered for its forward, freed, gathered again for its
    backward, and its gradients reduce-scattered. Theory per rank: 3 × (p−1)/p × 4Ψ bytes
    (two gathers, one reduce-scatter; FSDP pads each parameter to a multiple of p)."""

    counts_bytes = False
    zero_stage = 3
    collective_eval = True  # forward gathers every unit

    def __init__(self, ctx: BuildContext) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        comm = ctx.require_comm("torch-fsdp")
        group = native_group(comm, "torch-fsdp")
        self._skeleton = empty_copy(ctx.module)  # the result's module, filled at the end
        mesh = DeviceMesh.from_group(group, mesh_device_type(ctx, comm, "torch-fsdp"))
        for child in ctx.module.children():
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(ctx.module, mesh=mesh)
        super().__init__(ctx.module, ctx.make_optimizer(ctx.module.parameters()), comm)
        p = comm.world_size
        self.theory_bytes_per_step = 3 * (p - 1) / p * param_bytes(ctx.module)

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The local shards of the parameters, gradients and optimizer state (DTensors)."""
        from disttrain.train.memory import optimizer_tensors

        params: list[torch.Tensor] = list(self.module.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": optimizer_tensors(self.optimizer)}

    def trained_module(self) -> nn.Module:
        """The plain module with every parameter gathered (a collective on every rank)."""
        full = {name: p.full_tensor().detach().clone()  # type: ignore[attr-defined]
                for name, p in self.module.named_parameters()}
        buffers = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        for name, param in self._skeleton.named_parameters():
            param.data = full[name]
        for name, buffer in self._skeleton.named_buffers():
            buffer.data = buffers[name]
        return self._skeleton

    def close(self) -> None:
        self.optimizer = None
        gc.collect()


def build_torch_fsdp(ctx: BuildContext) -> Strategy:
    return TorchFSDPStrategy(ctx)
