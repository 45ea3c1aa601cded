"""Parameter groups under ZeRO: per-group optimizer options (weight decay, learning rate) on
flat shards that mix the parameters of several groups.

A torch optimizer takes parameter groups, ``[{"params": [...], "weight_decay": 0.0}, ...]``,
each with its own options. ZeRO's optimizer does not see the parameters: it updates flat
master shards (:mod:`.sharding`), and one shard may hold the end of a weight (decayed) and a
bias (not). ZeRO keeps its flat layouts, so its collectives and bytes stay as they are, and
hands the optimizer, per group, the *slices* of each master shard that hold that group's
parameters: views, so an update lands in the shard itself::

    parameters      w0 (decay) | b0 (no decay) | w1 (decay)
    rank 1's shard  [ w0[4:6] | b0[0:2] | w1[0:2] ]
    slices            decay     no decay  decay       three tensors in two groups

Consecutive pieces of one group make one slice; the padding at the end of the last shard
joins the last slice (its gradient is zero, so it stays zero under any of these options).
Without groups the optimizer gets each master whole, as before.

Groups are given as torch takes them, a list of dicts whose ``"params"`` are the model's
parameters (or their names), or as a function of a parameter's name returning its options
(parameters with equal options share a group). Every trainable parameter must be in a
group: ZeRO shards and trains all of them. A checkpoint (:mod:`.checkpoint`) sees each
slice as a tensor the optimizer updates (``ShardGroup.slices``), saved with its group's
options, so one resharded from N ranks to M keeps each element's state and each group's
options.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.parallel.zero.sharding import (
    GradShardHook,
    MasterSlice,
    OptimizerFactory,
    ShardLayout,
)

ParamGroups = Sequence[Mapping[str, Any]] | Callable[[str], Mapping[str, Any]]
"""A list of dicts as torch optimizers take (``"params"``: the model's parameters or their
names, the rest: that group's options), or ``name → options`` for each parameter."""



@dataclass(frozen=True)
class GroupPlan:
    """Each parameter group's options and the group of each parameter (by name)."""

    options: tuple[dict[str, Any], ...]
    group_of: Mapping[str, int]


def plan_groups(named: Sequence[tuple[str, torch.Tensor]], param_groups: ParamGroups | None
                ) -> GroupPlan | None:
    """The plan of ``param_groups`` over the trainable parameters ``named`` (None: none)."""
    if param_groups is None:
        return None
    if callable(param_groups):
        return _by_function(named, param_groups)
    if isinstance(param_groups, (Mapping, str)) or not isinstance(param_groups, Sequence):
        raise ValueError(f"param_groups must be a list of dicts (as torch optimizers take) or "
                         f"a function name → options, got {type(param_groups).__name__}")
    return _by_list(named, param_groups)


def _by_function(named: Sequence[tuple[str, torch.Tensor]],
                 options_of: Callable[[str], Mapping[str, Any]]) -> GroupPlan:
    options: list[dict[str, Any]] = []
    keys: dict[str, int] = {}
    group_of: dict[str, int] = {}
    for name, _ in named:
        found = options_of(name)
        if not isinstance(found, Mapping) or "params" in found:
            raise ValueError(f"param_groups({name!r}) must return a dict of optimizer options "
                             f"without 'params' (e.g. {{'weight_decay': 0.0}}), got {found!r}")
        key = repr(sorted(found.items()))
        if key not in keys:
            keys[key] = len(options)
            options.append(dict(found))
        group_of[name] = keys[key]
    return GroupPlan(tuple(options), group_of)


def _by_list(named: Sequence[tuple[str, torch.Tensor]],
             groups: Sequence[Mapping[str, Any]]) -> GroupPlan:
    by_id = {id(p): n for n, p in named}
    group_of: dict[str, int] = {}
    for g, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ValueError(f"param_groups[{g}] must be a dict with 'params' (the model's "
                             f"parameters or their names) and that group's options, got "
                             f"{type(group).__name__}")
        params = group["params"]
        for p in [params] if isinstance(params, (torch.Tensor, str)) else params:
            name = p if isinstance(p, str) else by_id.get(id(p))
            if name is None or name not in by_id.values():
                what = repr(p) if isinstance(p, str) else f"a tensor of shape {tuple(p.shape)}"
                raise ValueError(f"param_groups[{g}] holds {what}, which is not a trainable "
                                 f"parameter of the wrapped model; list the model's own "
                                 f"parameters (or their names)")
            if name in group_of:
                raise ValueError(f"parameter {name} is in param_groups[{group_of[name]}] and "
                                 f"param_groups[{g}]; put each parameter in one group")
            group_of[name] = g
    missing = [n for n, _ in named if n not in group_of]
    if missing:
        raise ValueError(f"parameters {missing[:3]} are in no group of param_groups; ZeRO "
                         f"shards and trains every parameter that requires grad: add them to "
                         f"a group (or set requires_grad=False)")
    options = tuple({k: v for k, v in group.items() if k != "params"} for group in groups)
    return GroupPlan(options, group_of)


def slice_runs(layout: ShardLayout, groups: Sequence[int], rank: int
               ) -> list[tuple[int, int, int]]:
    """``(group, start, end)`` runs that tile ``rank``'s shard of ``layout``, where
    ``groups[i]`` is the group of the layout's parameter ``i``: consecutive pieces of one
    group merged, the padding joined to the last run (a shard of padding alone: one run of
    the last parameter's group)."""
    runs: list[tuple[int, int, int]] = []
    for piece in layout.pieces[rank]:
        group, end = groups[piece.param], piece.shard_offset + piece.length
        if runs and runs[-1][0] == group and runs[-1][2] == piece.shard_offset:
            runs[-1] = (group, runs[-1][1], end)
        else:
            runs.append((group, piece.shard_offset, end))
    if not runs:
        return [(groups[-1], 0, layout.shard_size)]
    runs[-1] = (runs[-1][0], runs[-1][1], layout.shard_size)
    return runs


class ShardOptimizer:
    """The torch optimizer over a wrapper's master shards, by parameter group, and the
    update a ZeRO stage's ``step()`` ends with.

    ``shards``: each flat group's parameter names, layout and this rank's master shard, in
    ``shard_groups()`` order. ``slices[i]`` are the tensors the optimizer sees of shard i."""

    def __init__(self, factory: OptimizerFactory,
                 shards: Sequence[tuple[Sequence[str], ShardLayout, torch.Tensor]],
                 plan: GroupPlan | None, rank: int) -> None:
        self.masters = [master for _, _, master in shards]
        self.hooks: list[GradShardHook] = []
        self.slices: list[tuple[MasterSlice, ...]]
        if plan is None:
            self.slices = [(MasterSlice(0, 0, master),) for master in self.masters]
            self.optimizer = factory(list(self.masters))
            return
        self.slices = [
            tuple(MasterSlice(g, start, master[start:end]) for g, start, end in
                  slice_runs(layout, [plan.group_of[n] for n in names], rank))
            for names, layout, master in shards]
        params: list[list[torch.Tensor]] = [[] for _ in plan.options]
        for slices in self.slices:
            for s in slices:
                params[s.group].append(s.tensor)
        self.optimizer = factory([{"params": p, **options}
                                  for p, options in zip(params, plan.options)])

    def step(self, grads: list[torch.Tensor | None]) -> None:
        """Update every master from its reduced gradient shard (in the masters' dtype; None:
        no gradient, that shard is skipped as torch skips a parameter without one), after
        the gradient-shard hooks; the gradients are dropped again afterwards."""
        for hook in self.hooks:
            hook(grads)
        for master, slices, grad in zip(self.masters, self.slices, grads):
            master.grad = grad
            for s in slices:
                if s.tensor is not master:
                    s.tensor.grad = None if grad is None else (
                        grad[s.start:s.start + s.tensor.numel()])
        self.optimizer.step()
        for master, slices in zip(self.masters, self.slices):
            master.grad = None
            for s in slices:
                s.tensor.grad = None
