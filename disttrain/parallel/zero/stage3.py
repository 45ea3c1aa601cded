"""ZeRO stage 3: shard the parameters too; gather each layer just before it runs, then free it.

Rajbhandari et al. 2020 (P_os+g+p). Every rank keeps 1/N of each unit's parameters
(:class:`Unit`, below), of its gradients and of its optimizer state:
16Ψ/N bytes with bf16 and Adam. The full parameters of a unit exist only while it runs::

    forward   unit i:  wait all_gather(i) ─▶ start all_gather(i+1) (prefetch) ─▶ run ─▶ free(i)
    backward  unit i:  all_gather(i) (prefetched by unit i+1) ─▶ start all_gather(i−1)
                       ─▶ run backward ─▶ reduce_scatter(grads of i), async ─▶ free(i)
    step()             optimizer.step() on the shards; nothing to gather: the next forward does

Per step each rank moves (N−1)/N·Ψ twice by all-gather and once by reduce-scatter: 1.5×
the all-reduce of DDP. The gather before backward is triggered by a hook on the unit's
outputs (it fires when their gradient is ready); the reduction by a hook on the unit's
inputs (it fires when their gradient is complete: the unit's backward is over). Both are
points of the autograd graph, reached in the same order on every rank that runs the same
modules, so gathers and reductions interleave identically everywhere even when a
parameter has a gradient on some ranks only (it counts as zeros where it has none).
Waiting for all of a unit's parameter gradients instead would make the point of the
reduction depend on the rank. Units whose inputs need no gradient (the first layer) are
reduced by the end-of-backward callback, last, in reverse unit order
(:mod:`disttrain.parallel.backward` explains both rules).

A model built on the meta device is materialised unit by unit, never whole (:mod:`.meta`);
with ``replicate=`` the ranks shard inside a group and all-reduce each gradient shard across
the replicas (:mod:`.hybrid`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.backward import EndOfBackward
from disttrain.parallel.zero import meta
from disttrain.parallel.zero.groups import GradShardHook, ParamGroups, ShardOptimizer, plan_groups
from disttrain.parallel.zero.hybrid import broadcast_initial, check_groups
from disttrain.parallel.zero.memory import WrapMemory, optimizer_tensors
from disttrain.parallel.zero.sharding import (
    OptimizerFactory,
    ShardGroup,
    ZeroConfig,
    common_dtype,
    master_copy,
    param_views,
    shard_layout,
    shard_of,
    to_dtype,
    trainable,
)
from disttrain.parallel.zero.stage2 import Reductions, stage_grads
from disttrain.parallel.zero.units import (
    Unit,
    Use,
    assign_units,
    output_tensors,
    watch_inputs,
)

log = logging.getLogger(__name__)


class ZeRO3(nn.Module):
    """Stage 3: wraps ``model``; call it like the model, then :meth:`step`, :meth:`zero_grad`.

    ``units``: the modules gathered as one (default: every module that directly owns
    parameters). Outside a forward/backward the model's parameters are empty placeholders;
    this rank's values are in the shards (``shard_groups()``, checkpoints). ``comm`` is the
    ranks that shard; ``replicate``: the replicas of this rank's shard (hybrid sharding);
    ``meta_init``: how a model on the meta device is initialised (default: each module's
    ``reset_parameters()``); ``param_groups``: the optimizer's parameter groups
    (:mod:`.groups`). ``wrap_memory`` counts what wrapping held at once.
    """

    stage = 3

    def __init__(self, model: nn.Module, comm: Communicator, optimizer_factory: OptimizerFactory,
                 config: ZeroConfig | None = None,
                 units: list[nn.Module] | None = None, *,
                 replicate: Communicator | None = None,
                 meta_init: meta.MetaInit | None = None,
                 param_groups: ParamGroups | None = None) -> None:
        super().__init__()
        self.module, self.comm, self.config = model, comm, config or ZeroConfig()
        self.replicate = replicate
        comm.expect_workload("collectives")  # Gloo's I/O threads yield to compute (auto)
        check_groups(comm, replicate)
        named = trainable(model)
        groups = plan_groups(named, param_groups)
        self.param_dtype = common_dtype(named)
        self.reduce_dtype = self.config.reduce_dtype or self.param_dtype
        plan = meta.plan(model, meta_init, comm.device)
        device = named[0][1].device if plan is None else plan.device
        self._empty = torch.empty(0, dtype=self.param_dtype, device=device)
        self.wrap_memory = WrapMemory.of_model(model)
        assigned = [(module, [named[i] for i in indices])
                    for module, indices in assign_units(model, named, units)]
        self.units = ([self._make_unit(k, m, group) for k, (m, group) in enumerate(assigned)]
                      if plan is None else self._materialise(plan, assigned))
        self._update = ShardOptimizer(optimizer_factory, [(u.names, u.layout, u.master)
                                                          for u in self.units],
                                      groups, comm.rank)
        self.optimizer = self._update.optimizer
        self._reductions = Reductions(comm, self.config.algorithm, self.config.inflight_buckets,
                                      replicate, self.config.algorithm_for("all_reduce"))
        self._order: list[int] = []  # units in the order this forward ran them
        self._position: dict[int, int] = {}  # unit index → place in _order
        self._next_forward: dict[int, int] = {}  # prefetch plan, from the previous forward
        self._end = EndOfBackward(self._end_of_backward)
        self._hooks: list[Any] = []
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(self._pre_forward(u),
                                                                  with_kwargs=True))
            self._hooks.append(u.module.register_forward_hook(self._post_forward(u)))
            self._hooks += [p.register_post_accumulate_grad_hook(self._grad_ready(u, i))
                            for i, p in enumerate(u.params)]
        log.info("ZeRO-3: %d parameters in %d unit(s)", self.numel, len(self.units))

    def _make_unit(self, index: int, module: nn.Module, named: list[tuple[str, nn.Parameter]],
                   full: torch.Tensor | None = None) -> Unit:
        """The unit of ``named``; ``full``: its flat buffer already initialised (meta
        initialisation), else filled from the parameters and broadcast from rank 0."""
        params = [p for _, p in named]
        layout = shard_layout([p.numel() for p in params], self.comm.world_size)
        if full is None:
            full = torch.zeros(layout.padded_total, dtype=self.param_dtype,
                               device=params[0].device)
            self.wrap_memory.add(full)
            with torch.no_grad():
                for p, view in zip(params, param_views(full, params, layout)):
                    view.copy_(p.detach())
            broadcast_initial(full, self.config, self.comm, self.replicate)
        shard = shard_of(full, layout, self.comm.rank).clone()
        master = master_copy(shard, self.config.master_dtype)
        self.wrap_memory.add(shard, master)
        unit = Unit(index, module, tuple(n for n, _ in named), params, layout, full,
                    param_views(full, params, layout), shard, master, gathered=True)
        self.wrap_memory.drop(full, *params)  # the eager model's own storage goes too
        self._free(unit)
        return unit

    def _materialise(self, plan: meta.InitPlan,
                     assigned: list[tuple[nn.Module, list[tuple[str, nn.Parameter]]]]
                     ) -> list[Unit]:
        """Meta initialisation: each unit's buffer exists from just before the first of its
        modules is initialised until its own module is; then only the shard is kept."""
        meta.check_same_generator((self.comm, self.replicate), plan.device)
        fulls: dict[int, torch.Tensor] = {}
        built: dict[int, Unit] = {}

        def open_unit(k: int) -> None:
            params = [p for _, p in assigned[k][1]]
            layout = shard_layout([p.numel() for p in params], self.comm.world_size)
            fulls[k] = meta.bind_flat(params, layout, self.param_dtype, plan.device,
                                      self.wrap_memory)

        def close_unit(k: int) -> None:
            built[k] = self._make_unit(k, *assigned[k], full=fulls.pop(k))
            meta.detach_from_buffer(built[k].params)  # its shard is kept; views point there

        groups = [(m, [p for _, p in group]) for m, group in assigned]
        meta.materialise(plan, groups, self.wrap_memory, open_unit, close_unit)
        return [built[k] for k in range(len(assigned))]

    @property
    def numel(self) -> int:
        return sum(u.layout.total for u in self.units)

    # ---------------------------------------------------------------- gather / free
    def _gather(self, u: Unit, wait: bool = True) -> None:
        """Start all-gathering ``u`` (if it is not already); with ``wait``, finish it and
        point the parameters at the full buffer."""
        if not u.gathered:
            u.full.untyped_storage().resize_(u.full_nbytes)
            u.gather_work = self.comm.all_gather(u.full, u.shard, async_op=True,
                                                 algorithm=self.config.algorithm)
            u.gathered = True
        if wait and u.gather_work is not None:
            u.gather_work.wait()
            u.gather_work = None
            for p, view in zip(u.params, u.views):
                p.data = view

    def _free(self, u: Unit) -> None:
        if u.gather_work is not None:  # never free memory a collective is writing into
            u.gather_work.wait()
            u.gather_work = None
        for p in u.params:
            p.data = self._empty
        u.full.untyped_storage().resize_(0)
        u.gathered = False

    # ---------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._order, self._position = [], {}
        for u in self.units:
            u.open.clear()  # left over only if a forward raised
        output = self.module(*args, **kwargs)
        for u in self.units:  # prefetched but not run (a branch not taken): free
            if u.gathered:
                self._free(u)
        self._next_forward = dict(zip(self._order, self._order[1:]))
        return output

    def _pre_forward(self, u: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            self._gather(u)
            if u.index not in self._position:
                self._position[u.index] = len(self._order)
                self._order.append(u.index)
            if self.config.prefetch:
                nxt = self._next_forward.get(u.index, u.index + 1)
                if nxt < len(self.units):
                    self._gather(self.units[nxt], wait=False)
            if torch.is_grad_enabled():
                use = Use(None)
                use.pending = watch_inputs((args, kwargs), self._inputs_done(u, use)) or None
                u.uses.add(use)
                u.open.append(use)
        return hook

    def _post_forward(self, u: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if torch.is_grad_enabled():
                use = u.open.pop() if u.open else None  # the hooks keep it alive
                for t in output_tensors(output):
                    t.register_hook(self._pre_backward(u, use))
            self._free(u)
        return hook

    # ---------------------------------------------------------------- backward
    def _pre_backward(self, u: Unit, use: Use | None) -> Callable[[torch.Tensor], None]:
        # ``use`` rides along as a default argument: the hook lives as long as the forward's
        # graph, and so must a use none of whose inputs could be watched
        def hook(grad: torch.Tensor, _use: Use | None = use) -> None:
            self._end.arm()
            self._gather(u)
            if self.config.prefetch and u.index in self._position:
                position = self._position[u.index]
                if position > 0:
                    self._gather(self.units[self._order[position - 1]], wait=False)
        return hook

    def _inputs_done(self, u: Unit, use: Use) -> Callable[[torch.Tensor], None]:
        """Hook on each watched input of one use: the last one ends that use's backward;
        when no use is left, reduce the unit (the same event on every rank)."""
        def hook(grad: torch.Tensor) -> None:
            self._end.arm()
            if use.pending is not None:
                use.pending -= 1
                if use.pending == 0:
                    u.uses.discard(use)
            if not u.uses and not u.launched:
                self._launch(u)
        return hook

    def _grad_ready(self, u: Unit, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._end.arm()
            if u.launched:  # before: .grad just accumulates
                raise RuntimeError(
                    f"ZeRO-3: parameter {u.names[i]!r} received a gradient after its unit "
                    f"was reduced in this backward; it would be lost. A parameter must be "
                    f"used only inside its unit's forward")
            u.ready.add(i)
        return hook

    def _launch(self, u: Unit) -> None:
        """Move the unit's gradients to a staging buffer (zeros where a parameter has none),
        free them and the full parameters, reduce-scatter asynchronously."""
        u.launched = True
        u.ready.clear()
        staging = stage_grads(u.params, u.layout, self.reduce_dtype, u.full.device)
        self._free(u)
        self._reductions.start(u, staging, u.layout.shard_size)

    def _end_of_backward(self) -> None:
        """Autograd's queued callback: reduce every unit this backward did not (its inputs
        need no gradient, or it did not run here), in reverse unit order; start over."""
        for u in reversed(self.units):
            if not u.launched:
                self._launch(u)
        for u in self.units:
            u.launched = False
            if u.gathered:  # re-gathered by a prefetch after its reduction
                self._free(u)

    # ---------------------------------------------------------------- step
    def step(self) -> None:
        """Finish gradient reductions and update this rank's shards."""
        self._reductions.finish()  # each backward launched every unit: only wait
        self._update.step([None if u.grad_shard is None else to_dtype(u.grad_shard,
                                                                      u.master.dtype)
                           for u in self.units])
        self.reload_from_masters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradient shards and any gradient not yet reduced (locally:
        no collective runs here)."""
        self._reductions.discard()
        self._end.reset()
        for u in self.units:
            u.ready.clear()
            u.launched = False
            for p in u.params:
                p.grad = None
            if u.gathered:
                self._free(u)
            if set_to_none or u.grad_shard is None:
                u.grad_shard = None
            else:
                u.grad_shard.zero_()

    @contextmanager
    def gathered(self) -> Iterator[nn.Module]:
        """All parameters full inside the block (export, inspection): needs the whole model's
        memory on this rank, so it is for small models and tests, not for training."""
        for u in self.units:
            self._gather(u, wait=False)
        for u in self.units:
            self._gather(u)
        try:
            yield self.module
        finally:
            for u in self.units:
                self._free(u)

    def no_sync(self) -> AbstractContextManager[None]:
        """Stage 3 keeps no full gradient to accumulate into: micro-batches are reduced as
        they come (correct, one reduce-scatter per unit per micro-batch), so there is
        nothing to skip and accumulation needs no ``no_sync``."""
        return nullcontext()

    # ---------------------------------------------------------------- checkpoints, memory
    def shard_groups(self) -> list[ShardGroup]:
        return [ShardGroup(u.names, tuple(tuple(v.shape) for v in u.views), u.layout, u.master,
                           slices) for u, slices in zip(self.units, self._update.slices)]

    def register_grad_shard_hook(self, hook: GradShardHook) -> None:
        """Run ``hook`` on the reduced gradient shards in every ``step()``, before the
        update."""
        self._update.hooks.append(hook)

    def reload_from_masters(self) -> None:
        """Copy the master shards into the parameter shards (when they are separate)."""
        with torch.no_grad():
            for u in self.units:
                if u.master is not u.shard:
                    u.shard.copy_(u.master)

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "params": [t for u in self.units for t in (u.shard, u.full)]
            + list(self.module.parameters()),
            "grads": [u.grad_shard for u in self.units if u.grad_shard is not None]
            + [p.grad for p in self.module.parameters() if p.grad is not None],
            "optimizer": optimizer_tensors(self.optimizer),
        }

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
