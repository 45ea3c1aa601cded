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
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator, Work
from disttrain.parallel.backward import EndOfBackward
from disttrain.parallel.zero.memory import optimizer_tensors
from disttrain.parallel.zero.sharding import (
    OptimizerFactory,
    ShardGroup,
    ShardLayout,
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

log = logging.getLogger(__name__)


class ZeRO3(nn.Module):
    """Stage 3: wraps ``model``; call it like the model, then :meth:`step`, :meth:`zero_grad`.

    ``units``: the modules gathered as one (default: every module that directly owns
    parameters). Outside a forward/backward the model's parameters are empty placeholders;
    this rank's values are in the shards (``shard_groups()``, checkpoints).
    """

    stage = 3

    def __init__(self, model: nn.Module, comm: Communicator, optimizer_factory: OptimizerFactory,
                 config: ZeroConfig | None = None,
                 units: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.module, self.comm, self.config = model, comm, config or ZeroConfig()
        comm.expect_workload("collectives")  # Gloo's I/O threads yield to compute (auto)
        named = trainable(model)
        self.param_dtype = common_dtype(named)
        self.reduce_dtype = self.config.reduce_dtype or self.param_dtype
        self._empty = torch.empty(0, dtype=self.param_dtype, device=named[0][1].device)
        self.units = [self._make_unit(k, module, [named[i] for i in indices])
                      for k, (module, indices) in enumerate(assign_units(model, named, units))]
        self.optimizer = optimizer_factory([u.master for u in self.units])
        self._reductions = Reductions(comm, self.config.algorithm, self.config.inflight_buckets)
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

    def _make_unit(self, index: int, module: nn.Module,
                   named: list[tuple[str, nn.Parameter]]) -> Unit:
        params = [p for _, p in named]
        layout = shard_layout([p.numel() for p in params], self.comm.world_size)
        full = torch.zeros(layout.padded_total, dtype=self.param_dtype, device=params[0].device)
        views = param_views(full, params, layout)
        with torch.no_grad():
            for p, view in zip(params, views):
                view.copy_(p.detach())
        if self.config.broadcast_from_rank0 and self.comm.world_size > 1:
            self.comm.broadcast(full, 0, algorithm=self.config.algorithm_for("broadcast"))
        shard = shard_of(full, layout, self.comm.rank).clone()
        unit = Unit(index, module, tuple(n for n, _ in named), params, layout, full, views,
                    shard, master_copy(shard, self.config.master_dtype), gathered=True)
        self._free(unit)
        return unit

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
        for u in self.units:
            u.master.grad = None if u.grad_shard is None else to_dtype(u.grad_shard,
                                                                      u.master.dtype)
        self.optimizer.step()
        for u in self.units:
            u.master.grad = None
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
        return [ShardGroup(u.names, tuple(tuple(v.shape) for v in u.views), u.layout, u.master)
                for u in self.units]

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


# ----------------------------------------------------------------------
# Stage 3's units: the groups of parameters gathered together just before a module runs.
#
# A *unit* is a module whose parameters are all-gathered before its forward (and again
# before its backward) and freed right after. By default every module that directly owns
# trainable parameters is a unit (each ``Linear``, ``LayerNorm``, ``Embedding``); passing
# coarser units (e.g. transformer blocks) means fewer, larger collectives. Each parameter
# belongs to the innermost unit that contains it; parameters outside every unit go to the
# root (the whole model, gathered for the whole forward).
#
# A :class:`Unit`'s full flat buffer keeps one storage for its lifetime: *freeing* resizes
# that storage to 0 bytes and *gathering* resizes it back and fills it, so tensors autograd
# saved during forward (``weight.t()`` in a Linear) see the re-gathered values in backward.
#
# A unit's backward is over when the gradient of its inputs is complete (a hook on each
# input that requires grad), for every :class:`Use` of the unit: an event at the same place
# of backward on every rank, whichever parameters got gradients there.

@dataclass
class Unit:
    """One gather/free group and this rank's shard of it."""

    index: int
    module: nn.Module
    names: tuple[str, ...]
    params: list[nn.Parameter]
    layout: ShardLayout
    full: torch.Tensor  # padded flat buffer; storage of 0 bytes while freed
    views: list[torch.Tensor]  # parameter-shaped views of ``full``
    shard: torch.Tensor  # this rank's slice, parameter dtype, kept
    master: torch.Tensor  # optimizer's parameter: ``shard`` itself or an fp32 copy
    grad_shard: torch.Tensor | None = None
    gathered: bool = False
    gather_work: Work | None = None
    ready: set[int] = field(default_factory=set)  # parameters with a gradient, this backward
    uses: weakref.WeakSet[Use] = field(default_factory=weakref.WeakSet)  # backward to come
    open: list[Use] = field(default_factory=list)  # forwards running (pre- to post-hook)
    launched: bool = False  # gradients reduced in this backward

    @property
    def full_nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()


def assign_units(model: nn.Module, named: Sequence[tuple[str, nn.Parameter]],
                 units: Sequence[nn.Module] | None) -> list[tuple[nn.Module, list[int]]]:
    """Map each parameter (index into ``named``) to its unit; returns (module, indices)
    per non-empty unit, in model order. Raises if a parameter is shared by two units that
    are not nested (tied weights need a unit that holds both users)."""
    modules = _default_units(model) if units is None else list(units)
    contained = [{id(p) for p in m.parameters()} for m in modules]
    order = sorted(range(len(modules)), key=lambda k: len(contained[k]))  # innermost first
    owner: dict[int, int] = {}
    for i, (name, p) in enumerate(named):
        holders = [k for k in order if id(p) in contained[k]]
        if not holders:
            continue
        inner = holders[0]
        for k in holders[1:]:
            if not any(m is modules[inner] for m in modules[k].modules()):
                raise ValueError(
                    f"parameter {name} is used by two stage-3 units that are not nested "
                    f"({type(modules[inner]).__name__} and {type(modules[k]).__name__}); tied "
                    f"weights must live in one unit: pass units=[...] with a module that "
                    f"contains both users")
        owner[i] = inner
    grouped: dict[int, list[int]] = {}
    for i in range(len(named)):
        grouped.setdefault(owner.get(i, -1), []).append(i)
    result = [(modules[k], grouped[k]) for k in range(len(modules)) if k in grouped]
    if -1 in grouped:  # parameters outside every unit: the root holds them
        result.insert(0, (model, grouped[-1]))
    return result


def _default_units(model: nn.Module) -> list[nn.Module]:
    """Every module that directly owns a trainable parameter, in ``model.modules()`` order."""
    return [m for m in model.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))]


class Use:
    """One forward of a unit under grad mode whose backward has not finished.

    Apart from the unit's weak set, only hooks on that forward's autograd graph refer to it,
    so it vanishes with the graph when no backward comes. ``pending`` counts the watched
    inputs whose gradient is still to come; ``None`` when no input could be watched (then
    only the end of backward knows)."""

    __slots__ = ("__weakref__", "pending")

    def __init__(self, pending: int | None) -> None:
        self.pending = pending


def watch_inputs(inputs: object, hook: Callable[[torch.Tensor], None]) -> int:
    """Register ``hook`` on every non-leaf tensor requiring grad in ``inputs``; how many.

    A leaf's hook runs in its own accumulation, which autograd may schedule before the
    unit's parameters get theirs, so leaves are not watched."""
    watched = [t for t in output_tensors(inputs) if t.grad_fn is not None]
    for t in watched:
        t.register_hook(hook)
    return len(watched)


def output_tensors(output: object) -> list[torch.Tensor]:
    """Tensors requiring grad inside a module's output or inputs (tensor, tuple, list, dict)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in output_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in output_tensors(item)]
    return []
