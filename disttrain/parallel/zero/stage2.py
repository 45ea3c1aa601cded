"""ZeRO stage 2: also shard the gradients, reduce-scattered bucket by bucket during backward.

Rajbhandari et al. 2020 (P_os+g). Parameters are grouped into buckets in reverse order
(the order backward produces gradients, as in DDP); each bucket is a flat group sharded
over all ranks. When every gradient of a bucket has been accumulated, it is copied into a
staging buffer, the parameters' ``.grad`` are dropped, and the bucket is reduce-scattered
asynchronously while backward goes on::

    backward ─▶ grads of bucket 0 ready ─▶ reduce_scatter(b0)  (progress thread)
             ─▶ grads of bucket 1 ready ─▶ reduce_scatter(b1)  ...
    step()   ─▶ wait; each rank has the average gradient of its shard of every bucket
             ─▶ optimizer.step() on the shards ─▶ all_gather every bucket's parameters

Buckets are launched in bucket order on every rank (a bucket that is ready early waits for
the ones before it), so collectives match across ranks whatever order hooks fire in. A
bucket still incomplete when backward ends (a parameter without gradient on this rank) is
launched by the end-of-backward callback, in bucket order, with zeros for the missing
gradients (both rules: :mod:`disttrain.parallel.backward`; the reductions:
:class:`Reductions`, below): every rank reduces every bucket exactly once per backward, so
micro-batches accumulate without ``no_sync``. Each rank keeps only its gradient shards
(GΨ/N): 2Ψ + (2 + K)Ψ/N bytes with bf16 and Adam.
Communication is stage 1's: (N−1)/N·Ψ reduce-scatter + (N−1)/N·Ψ all-gather.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from disttrain.comm import Communicator, Work
from disttrain.parallel.backward import EndOfBackward, InOrderLauncher
from disttrain.parallel.zero import meta
from disttrain.parallel.zero.groups import GradShardHook, ParamGroups, ShardOptimizer, plan_groups
from disttrain.parallel.zero.hybrid import broadcast_initial, check_groups
from disttrain.parallel.zero.memory import WrapMemory, optimizer_tensors
from disttrain.parallel.zero.sharding import (
    OptimizerFactory,
    ShardGroup,
    ShardLayout,
    ZeroConfig,
    common_dtype,
    master_copy,
    param_views,
    partition,
    shard_layout,
    shard_of,
    to_dtype,
    trainable,
)

log = logging.getLogger(__name__)


@dataclass
class Bucket:
    """A flat group of parameters reduced together; ``region`` is its slice of the model's
    flat parameter buffer, ``grad_shard`` this rank's reduced gradient (kept until
    ``zero_grad``)."""

    index: int
    names: tuple[str, ...]
    params: list[nn.Parameter]
    layout: ShardLayout
    region: torch.Tensor
    master: torch.Tensor
    grad_shard: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)


class ZeRO2:
    """Stage 2 around ``model``: forward/backward on the model, then :meth:`step` and
    :meth:`zero_grad` (same use as :class:`~disttrain.parallel.zero.stage1.ZeRO1`, and the
    same ``replicate``, ``meta_init`` and ``param_groups``)."""

    stage = 2

    def __init__(self, model: nn.Module, comm: Communicator, optimizer_factory: OptimizerFactory,
                 config: ZeroConfig | None = None, *, replicate: Communicator | None = None,
                 meta_init: meta.MetaInit | None = None,
                 param_groups: ParamGroups | None = None) -> None:
        self.module, self.comm, self.config = model, comm, config or ZeroConfig()
        self.replicate = replicate
        comm.expect_workload("collectives")  # Gloo's I/O threads yield to compute (auto)
        check_groups(comm, replicate)
        in_order = trainable(model)
        grouping = plan_groups(in_order, param_groups)  # first appearance: the model's order
        named = in_order[::-1]  # backward produces the last parameters' grads first
        self.param_dtype = common_dtype(named)
        self.reduce_dtype = self.config.reduce_dtype or self.param_dtype
        plan = meta.plan(model, meta_init, comm.device)
        self.wrap_memory = WrapMemory.of_model(model)
        element = named[0][1].element_size()
        groups = partition([p.numel() * element for _, p in named], self.config.bucket_bytes)
        layouts = [shard_layout([named[i][1].numel() for i in g], comm.world_size)
                   for g in groups]
        self._flat = torch.zeros(sum(lay.padded_total for lay in layouts),
                                 dtype=self.param_dtype,
                                 device=named[0][1].device if plan is None else plan.device)
        self.wrap_memory.add(self._flat)
        self.buckets = self._make_buckets(named, groups, layouts, plan is not None)
        if plan is None:
            broadcast_initial(self._flat, self.config, comm, replicate)
        else:  # every rank draws the same values: nothing to broadcast
            meta.check_same_generator((comm, replicate), plan.device)
            meta.materialise(plan, [(model, [p for _, p in named])], self.wrap_memory)
        for b in self.buckets:  # masters after the broadcast: a copy must see rank 0's values
            b.master = master_copy(shard_of(b.region, b.layout, comm.rank),
                                   self.config.master_dtype)
            self.wrap_memory.add(b.master)
        self._update = ShardOptimizer(optimizer_factory, [(b.names, b.layout, b.master)
                                                          for b in self.buckets],
                                      grouping, comm.rank)
        self.optimizer = self._update.optimizer
        self._reductions = Reductions(comm, self.config.algorithm, self.config.inflight_buckets,
                                      replicate, self.config.algorithm_for("all_reduce"))
        self._launcher = InOrderLauncher(len(self.buckets), self._launch)
        self._end = EndOfBackward(self._end_of_backward)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(b, i))
                       for b in self.buckets for i, p in enumerate(b.params)]
        log.info("ZeRO-2: %d parameters in %d bucket(s)", self.numel, len(self.buckets))

    def _make_buckets(self, named: list[tuple[str, nn.Parameter]], groups: list[list[int]],
                      layouts: list[ShardLayout], on_meta: bool) -> list[Bucket]:
        buckets, start = [], 0
        for index, (group, layout) in enumerate(zip(groups, layouts)):
            region = self._flat[start:start + layout.padded_total]
            start += layout.padded_total
            params = [named[i][1] for i in group]
            views = param_views(region, params, layout)
            if on_meta:  # initialised later, in place (meta.materialise)
                meta.bind(params, views)
            else:
                self.wrap_memory.drop(*params)  # the eager model's own storage goes
                with torch.no_grad():
                    for p, view in zip(params, views):
                        view.copy_(p.detach())
                        p.data = view  # the model now reads the flat buffer
            buckets.append(Bucket(index, tuple(named[i][0] for i in group), params, layout,
                                  region, master=region[:0]))
        return buckets

    @property
    def numel(self) -> int:
        return sum(b.layout.total for b in self.buckets)

    # ---------------------------------------------------------------- backward
    def _hook(self, bucket: Bucket, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad_accumulated(param: torch.Tensor) -> None:
            self._end.arm()
            if self._launcher.launched(bucket.index):  # before: .grad just accumulates
                raise RuntimeError(
                    f"ZeRO-2: parameter {bucket.names[i]!r} received a gradient after its "
                    f"bucket was reduced in this backward; it would be lost. Reentrant "
                    f"activation checkpointing does this to a parameter used both inside and "
                    f"outside the checkpointed part: use "
                    f"torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")
            bucket.ready.add(i)
            if len(bucket.ready) == len(bucket.params):
                self._launcher.mark_ready(bucket.index)
        return on_grad_accumulated

    def _launch(self, index: int) -> None:
        """Copy the bucket's gradients to a staging buffer (zeros where a parameter has none),
        free them, reduce-scatter asynchronously."""
        b = self.buckets[index]
        b.ready.clear()
        staging = stage_grads(b.params, b.layout, self.reduce_dtype, b.region.device)
        self._reductions.start(b, staging, b.layout.shard_size)

    def _end_of_backward(self) -> None:
        """Autograd's queued callback: launch the buckets this backward did not complete
        (a parameter without gradient on this rank), in bucket order, then start over."""
        self._launcher.finish()

    @property
    def peak_staging_bytes(self) -> int:
        """The largest sum of staging buffers alive at once so far."""
        return self._reductions.peak_staging_bytes

    # ---------------------------------------------------------------- step
    def step(self) -> None:
        """Finish the gradient reductions, update this rank's shards, gather parameters."""
        self._reductions.finish()  # each backward launched every bucket: only wait
        self._update.step([None if b.grad_shard is None else to_dtype(b.grad_shard,
                                                                      b.master.dtype)
                           for b in self.buckets])
        self._publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradient shards and any gradient not yet reduced."""
        self._reductions.discard()
        self._launcher.reset()
        self._end.reset()
        for b in self.buckets:
            b.ready.clear()
            for p in b.params:
                p.grad = None
            if set_to_none or b.grad_shard is None:
                b.grad_shard = None
            else:
                b.grad_shard.zero_()

    def no_sync(self) -> AbstractContextManager[None]:
        """Stage 2 keeps no full gradient to accumulate into: micro-batches are reduced as
        they come (correct, one reduce-scatter per bucket per micro-batch), so there is
        nothing to skip and accumulation needs no ``no_sync``."""
        return nullcontext()

    def _publish(self) -> None:
        works = []
        for b in self.buckets:
            mine = b.master.detach().to(self.param_dtype, copy=True)
            works.append((self.comm.all_gather(b.region, mine, algorithm=self.config.algorithm,
                                               async_op=True), mine))
        for work, _mine in works:
            if work is not None:
                work.wait()

    # ---------------------------------------------------------------- checkpoints, memory
    def shard_groups(self) -> list[ShardGroup]:
        return [ShardGroup(b.names, tuple(tuple(p.shape) for p in b.params), b.layout, b.master,
                           slices) for b, slices in zip(self.buckets, self._update.slices)]

    def reload_from_masters(self) -> None:
        self._publish()

    def register_grad_shard_hook(self, hook: GradShardHook) -> None:
        """Run ``hook`` on the reduced gradient shards in every ``step()``, before the
        update."""
        self._update.hooks.append(hook)

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        grads = [b.grad_shard for b in self.buckets if b.grad_shard is not None]
        grads += [p.grad for p in self.module.parameters() if p.grad is not None]
        return {"params": [self._flat, *self.module.parameters()], "grads": grads,
                "optimizer": optimizer_tensors(self.optimizer)}

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the wrapper stops reducing)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


# ----------------------------------------------------------------------
# What stages 2 and 3 share besides the launch order (:mod:`disttrain.parallel.backward`):
# a reduction moves a group's gradients to a staging buffer and reduce-scatters it
# asynchronously, at most ``inflight_buckets`` at once.


def stage_grads(params: Sequence[nn.Parameter], layout: ShardLayout, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """A padded flat buffer (``layout``) of the parameters' gradients in ``dtype``, zeros where
    a parameter has none (it got no gradient on this rank); the ``.grad`` are dropped.

    Slices are flat, not parameter-shaped: a stage-3 unit that forward never called still
    has its 0-element placeholders as parameters when the end of backward stages it."""
    staging = torch.empty(layout.padded_total, dtype=dtype, device=device)
    staging[layout.total:].zero_()  # padding contributes zeros
    with torch.no_grad():
        for p, start, numel in zip(params, layout.offsets(), layout.numels):
            view = staging[start:start + numel]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
                p.grad = None
    return staging


class Reduced(Protocol):
    """A bucket or unit: what its reductions add up into."""

    grad_shard: torch.Tensor | None


class Reductions:
    """Gradient reduce-scatters in flight, oldest first; at most ``limit`` staging buffers
    alive (the oldest is waited for before another starts), and each result added to its
    group's ``grad_shard`` (micro-batches accumulate there). With ``replicate`` (hybrid
    sharding, :mod:`.hybrid`) each reduced shard is then averaged over the replicas by an
    asynchronous all-reduce, started in reduction order (the same on every replica) once
    its reduce-scatter is done, and added when that completes."""

    def __init__(self, comm: Communicator, algorithm: str | None, limit: int,
                 replicate: Communicator | None = None,
                 replicate_algorithm: str | None = None) -> None:
        self.comm, self.algorithm, self.limit = comm, algorithm, limit
        self.replicate, self.replicate_algorithm = replicate, replicate_algorithm
        self.pending: list[tuple[Reduced, Work | None, torch.Tensor, torch.Tensor]] = []
        self.replicating: list[tuple[Reduced, Work | None, torch.Tensor]] = []
        self.peak_staging_bytes = 0  # largest sum of staging buffers alive at once

    def start(self, group: Reduced, staging: torch.Tensor, shard_size: int) -> None:
        """Reduce-scatter (average) ``staging`` asynchronously into ``group``'s shard."""
        out = staging.new_empty(shard_size)
        work = self.comm.reduce_scatter(out, staging, "avg", algorithm=self.algorithm,
                                        async_op=True)
        self.pending.append((group, work, out, staging))
        self.peak_staging_bytes = max(self.peak_staging_bytes, sum(
            item[3].numel() * item[3].element_size() for item in self.pending))
        while len(self.pending) >= self.limit or (
                self.pending and _done(self.pending[0][1])):
            self._accumulate(self.pending.pop(0))

    def finish(self) -> None:
        """Wait for every reduction and add it to its group's gradient shard."""
        while self.pending:
            self._accumulate(self.pending.pop(0))
        while self.replicating:
            self._add(*self.replicating.pop(0))

    def discard(self) -> None:
        """Wait for every reduction (their buffers must outlive them) and drop the results."""
        for work in [item[1] for item in self.pending] + [r[1] for r in self.replicating]:
            if work is not None:
                work.wait()
        self.pending.clear()
        self.replicating.clear()

    def _accumulate(self, item: tuple[Reduced, Work | None, torch.Tensor, torch.Tensor]
                    ) -> None:
        group, work, out, _staging = item
        if work is not None:
            work.wait()
        if self.replicate is None:
            self._add(group, None, out)
            return
        self.replicating.append((group, self.replicate.all_reduce(
            out, "avg", algorithm=self.replicate_algorithm, async_op=True), out))
        while self.replicating and _done(self.replicating[0][1]):
            self._add(*self.replicating.pop(0))

    @staticmethod
    def _add(group: Reduced, work: Work | None, out: torch.Tensor) -> None:
        if work is not None:
            work.wait()
        group.grad_shard = out if group.grad_shard is None else group.grad_shard.add_(out)


def _done(work: Work | None) -> bool:
    return work is None or work.is_completed()
