"""ZeRO stage 1: every rank keeps the optimizer state of its 1/N shard of the parameters only.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (P_os). Parameters and gradients stay replicated (each rank runs the whole model);
the optimizer (Adam's two moments, SGD's momentum, fp32 master weights) exists once across
the ranks instead of N times. One step::

    backward          every rank: full local gradient, accumulated in one flat buffer
    reduce_scatter    rank r receives the average gradient of its shard only   (N−1)/N·Ψ
    optimizer.step()  on the flat shard (any torch optimizer; state: shard-sized)
    all_gather        every rank receives every updated shard → full parameters (N−1)/N·Ψ

reduce-scatter + all-gather move exactly what an all-reduce moves (2(N−1)/N·Ψ), so stage 1
costs DDP's bandwidth and saves the optimizer state: 4Ψ + KΨ/N bytes instead of (4 + K)Ψ
with bf16 parameters (K = 12 for Adam with fp32 master weights).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.zero import meta
from disttrain.parallel.zero.groups import GradShardHook, ParamGroups, ShardOptimizer, plan_groups
from disttrain.parallel.zero.hybrid import broadcast_initial, check_groups
from disttrain.parallel.zero.memory import WrapMemory, optimizer_tensors
from disttrain.parallel.zero.sharding import (
    OptimizerFactory,
    ShardGroup,
    ZeroConfig,
    common_dtype,
    flatten_into_views,
    master_copy,
    param_views,
    shard_layout,
    shard_of,
    to_dtype,
    trainable,
)

log = logging.getLogger(__name__)


class ZeRO1:
    """Stage 1 around ``model``: run forward/backward on the model, then :meth:`step`.

    ::

        zero = ZeRO1(model, comm, lambda p: torch.optim.Adam(p, lr=1e-3))
        loss_fn(model(x), y).backward()
        zero.step()
        zero.zero_grad()

    ``zero.optimizer`` is the torch optimizer over this rank's flat shard (give it to an LR
    scheduler). Gradients are averaged over ranks, as in DDP. ``comm`` is the ranks that
    shard; ``replicate``: the replicas of this rank's shard (hybrid sharding, :mod:`.hybrid`);
    ``meta_init``: how a model built on the meta device is initialised (:mod:`.meta`; it is
    materialised straight into the flat buffer); ``param_groups``: the optimizer's parameter
    groups, as torch takes them or as a function name → options (:mod:`.groups`).
    ``wrap_memory`` counts what wrapping held.
    """

    stage = 1

    def __init__(self, model: nn.Module, comm: Communicator, optimizer_factory: OptimizerFactory,
                 config: ZeroConfig | None = None, *, replicate: Communicator | None = None,
                 meta_init: meta.MetaInit | None = None,
                 param_groups: ParamGroups | None = None) -> None:
        self.module, self.comm, self.config = model, comm, config or ZeroConfig()
        self.replicate = replicate
        comm.expect_workload("collectives")  # Gloo's I/O threads yield to compute (auto)
        check_groups(comm, replicate)
        named = trainable(model)
        groups = plan_groups(named, param_groups)
        self.names = tuple(n for n, _ in named)
        self._params = [p for _, p in named]
        self.param_dtype = common_dtype(named)
        self.reduce_dtype = self.config.reduce_dtype or self.param_dtype
        self.layout = shard_layout([p.numel() for p in self._params], comm.world_size)
        plan = meta.plan(model, meta_init, comm.device)
        self.wrap_memory = WrapMemory.of_model(model)
        if plan is None:
            eager = [p.data for p in self._params]  # the model's own storage, until rebound
            self._flat, _ = flatten_into_views(self._params, self.layout, self.param_dtype)
            self.wrap_memory.add(self._flat)
            self.wrap_memory.drop(*eager)
            del eager
            broadcast_initial(self._flat, self.config, comm, replicate)
        else:  # every rank draws the same values: nothing to broadcast
            meta.check_same_generator((comm, replicate), plan.device)
            self._flat = meta.bind_flat(self._params, self.layout, self.param_dtype,
                                        plan.device, self.wrap_memory)
            meta.materialise(plan, [(model, self._params)], self.wrap_memory)
        self._grads = torch.zeros_like(self._flat)  # p.grad are views: backward adds in place
        self._grad_views = param_views(self._grads, self._params, self.layout)
        for p, view in zip(self._params, self._grad_views):
            p.grad = view
        self.master = master_copy(shard_of(self._flat, self.layout, comm.rank),
                                  self.config.master_dtype)
        self.wrap_memory.add(self._grads, self.master)
        self._update = ShardOptimizer(optimizer_factory, [(self.names, self.layout, self.master)],
                                      groups, comm.rank)
        self.optimizer = self._update.optimizer
        log.info("ZeRO-1: %d parameters, shard of %d elements per rank", self.layout.total,
                 self.layout.shard_size)

    @property
    def numel(self) -> int:
        """Ψ: trainable parameters in the model."""
        return self.layout.total

    # ---------------------------------------------------------------- training
    def step(self) -> None:
        """Average gradients into this rank's shard, update it, gather every shard."""
        self._adopt_grads()
        grads = to_dtype(self._grads, self.reduce_dtype)
        shard = grads.new_empty(self.layout.shard_size)
        self.comm.reduce_scatter(shard, grads, "avg", algorithm=self.config.algorithm)
        if self.replicate is not None:  # hybrid: average the shard over its replicas
            self.replicate.all_reduce(shard, "avg",
                                      algorithm=self.config.algorithm_for("all_reduce"))
        self._update.step([to_dtype(shard, self.master.dtype)])
        self._publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffer. Stage 1 keeps full gradients by design, so the buffer
        stays allocated either way (``set_to_none`` is accepted for the optimizer API)."""
        self._grads.zero_()
        for p, view in zip(self._params, self._grad_views):
            p.grad = view

    def no_sync(self) -> AbstractContextManager[None]:
        """Nothing to skip: stage 1 reduces gradients only in ``step()``, so micro-batches
        already accumulate locally for free."""
        return nullcontext()

    def _adopt_grads(self) -> None:
        """Bring gradients the user replaced (``model.zero_grad()`` sets them to None and
        autograd then allocates new ones) back into the flat buffer."""
        for p, view in zip(self._params, self._grad_views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    def _publish(self) -> None:
        """All-gather the updated shards into the flat parameter buffer (the model's memory)."""
        mine = self.master.detach().to(self.param_dtype, copy=True)
        self.comm.all_gather(self._flat, mine, algorithm=self.config.algorithm)

    # ---------------------------------------------------------------- checkpoints, memory
    def shard_groups(self) -> list[ShardGroup]:
        shapes = tuple(tuple(p.shape) for p in self._params)
        return [ShardGroup(self.names, shapes, self.layout, self.master, self._update.slices[0])]

    def reload_from_masters(self) -> None:
        """After the master shard was overwritten (checkpoint load): refresh the model."""
        self._publish()

    def register_grad_shard_hook(self, hook: GradShardHook) -> None:
        """Run ``hook`` on the reduced gradient shard in every ``step()``, before the update."""
        self._update.hooks.append(hook)

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor this rank holds for the model's state, by category."""
        return {"params": [self._flat, *self.module.parameters()],
                "grads": [self._grads],
                "optimizer": optimizer_tensors(self.optimizer)}
