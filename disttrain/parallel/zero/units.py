"""Stage 3's units: the groups of parameters gathered together just before a module runs.

A *unit* is a module whose parameters are all-gathered before its forward (and again
before its backward) and freed right after. By default every module that directly owns
trainable parameters is a unit (each ``Linear``, ``LayerNorm``, ``Embedding``); passing
coarser units (e.g. transformer blocks) means fewer, larger collectives. Each parameter
belongs to the innermost unit that contains it; parameters outside every unit go to the
root (the whole model, gathered for the whole forward).

A :class:`Unit`'s full flat buffer keeps one storage for its lifetime: *freeing* resizes
that storage to 0 bytes and *gathering* resizes it back and fills it, so tensors autograd
saved during forward (``weight.t()`` in a Linear) see the re-gathered values in backward.

A unit's backward is over when the gradient of its inputs is complete (a hook on each
input that requires grad), for every :class:`Use` of the unit: an event at the same place
of backward on every rank, whichever parameters got gradients there.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from disttrain.comm import Work
from disttrain.parallel.zero.sharding import ShardLayout


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
    """Every module that directly owns a trainable parameter, in ``model.modules()`` order,
    but those that share one with another (tied weights: GPT-2's embedding and LM head):
    their parameters fall to the root, which holds them gathered for the whole forward."""
    units = [m for m in model.modules()
             if any(p.requires_grad for p in m.parameters(recurse=False))]
    users: dict[int, int] = {}
    for m in units:
        for p in m.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    return [m for m in units if all(users[id(p)] == 1 for p in m.parameters(recurse=False))]


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
