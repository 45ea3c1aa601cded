"""Apply a tensor-parallel plan to any model: :func:`parallelize`.

::

    tp = parallelize(model, tp_comm, plan, sequence_parallel=True)   # every tp rank
    out = tp.module(input_ids=x, labels=y)         # a transformers model: .loss as usual
    loss = tp.loss(tp.module(x), y)                # or: logits (split) and aligned targets
    loss.backward()
    tp.reduce_sequence_parallel_grads()            # SP only: norms' gradients over tp
    state = tp.full_state_dict()                   # the unsplit model's, its own names

The plan (:mod:`.plan`; ``None``: the built-in plan for the model, :mod:`.plans`) is
matched against the model's module names before anything changes: a pattern that matches
nothing, or two patterns for one module, is a one-line ValueError. The styles are then
applied parents first (a parent's replacement keeps its children's names), each module
replaced in place under its own name, so parameter names, checkpoints and the model's own
``forward`` stay the model's. By default the model is deep-copied first and left as it was.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.mixed_precision import at_least_fp32
from disttrain.parallel.tensor.layers import full_state_dict, load_full_state_dict
from disttrain.parallel.tensor.ops import (
    TPGroup,
    gather_vocab,
    reduce_sequence_parallel_grads,
    vocab_parallel_loss,
)
from disttrain.parallel.tensor.plan import Plan, ShardContext, Style, Styles, VocabShard
from disttrain.parallel.tensor.plans import plan_for
from disttrain.parallel.tensor.transformer import (
    TensorParallelLM,
    check_divisible,
    lm_parts,
    transformer_lm_plan,
)


@dataclass(eq=False)
class Parallelized:
    """This rank's shard of a model (``module``) and what training it needs: the
    vocabulary-parallel loss, the sequence-parallel gradients, the full state dict."""

    module: nn.Module
    group: TPGroup
    sequence_parallel: bool
    vocab: VocabShard | None  # None: the plan has no VocabHead, the logits are whole
    sequence_parameters: list[nn.Parameter]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor,
             ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy over the tokens whose target is not ``ignore_index``, from
        this rank's logits (targets aligned with the logits, no shift): what
        ``F.cross_entropy`` gives on the whole logits."""
        if self.vocab is None:
            return F.cross_entropy(at_least_fp32(logits.flatten(0, -2)), targets.flatten(),
                                   ignore_index=ignore_index)
        return vocab_parallel_loss(logits, targets, self.group, self.vocab.start,
                                   ignore_index)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's logits joined (for evaluation; a collective)."""
        return logits if self.vocab is None else gather_vocab(logits, self.group)

    def sequence_parallel_parameters(self, within: nn.Module | None = None
                                     ) -> list[nn.Parameter]:
        """The replicated parameters that see this rank's positions only (empty without
        sequence parallelism), of ``within`` (a pipeline stage of the shard) or all."""
        if within is None:
            return list(self.sequence_parameters)
        mine = {id(p) for p in self.sequence_parameters}
        return [p for p in within.parameters() if id(p) in mine]

    def reduce_sequence_parallel_grads(self, within: nn.Module | None = None) -> None:
        """Sum their gradients over the group (one flat all-reduce; after backward,
        before the optimizer)."""
        reduce_sequence_parallel_grads(self.sequence_parallel_parameters(within), self.group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit model's state dict, on every rank (a collective)."""
        return full_state_dict(self.module, self.group)

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load an unsplit state dict (:meth:`full_state_dict`'s) into this rank's shard."""
        load_full_state_dict(self.module, self.group, state)


def as_group(tp: Any, algorithm: str | None = None) -> TPGroup:
    """The tensor-parallel group from a Communicator, a TPGroup or a device mesh (its
    ``tp`` group)."""
    if isinstance(tp, TPGroup):
        return tp
    if isinstance(tp, Communicator) or not callable(getattr(tp, "group", None)):
        return TPGroup(tp, algorithm)
    comm = tp.group("tp")
    if comm is None:
        raise ValueError("the mesh's tp dimension has size 1: there is nothing to split; "
                         "build the mesh with tp > 1 or skip parallelize")
    return TPGroup(comm, algorithm)


def match(plan: Plan, model: nn.Module) -> dict[str, tuple[Style, ...]]:
    """Module name → its styles, parents first; a ValueError for a pattern that matches
    no module or a module that two patterns match."""
    names = [name for name, _ in model.named_modules()]
    found: dict[str, tuple[Style, ...]] = {}
    by: dict[str, str] = {}
    for pattern in plan.styles:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            example = next((n for n in names if n.count(".") >= 2), names[-1])
            raise ValueError(f"plan entry {pattern!r} matches no module of "
                             f"{type(model).__name__} (names look like {example!r}); fix "
                             f"the pattern or remove it")
        for name in hits:
            if name in by:
                raise ValueError(f"{name or 'the model'} matches both {by[name]!r} and "
                                 f"{pattern!r}; give each module one entry (a tuple for "
                                 f"several styles)")
            by[name], found[name] = pattern, plan.styles_of(pattern)
    return {name: found[name] for name in names if name in found}


def _put(root: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """``root`` with ``module`` at ``name`` (the new root when ``name`` is ``""``)."""
    if not name:
        return module
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent), leaf, module)
    return root


def parallelize(model: nn.Module, tp: Communicator | TPGroup | Any,
                plan: Plan | Mapping[str, Styles] | None = None, *,
                sequence_parallel: bool = False, algorithm: str | None = None,
                inplace: bool = False) -> Parallelized:
    """This rank's tensor-parallel shard of ``model`` (every rank of the group calls it
    with the same model: same seed or weights). ``tp``: the group's Communicator (or a
    TPGroup, or a device mesh: its tp group); ``plan``: a :class:`~.plan.Plan`, a plain
    mapping (batch-first activations), or None for the model's built-in plan;
    ``algorithm``: the collectives' algorithm (None: the communicator's default);
    ``inplace``: split ``model`` itself instead of a deep copy (less memory)."""
    group = as_group(tp, algorithm)
    if plan is None:
        plan = plan_for(model)
    elif not isinstance(plan, Plan):
        plan = Plan(dict(plan))
    matches = match(plan, model)
    work = model if inplace else copy.deepcopy(model)
    ctx = ShardContext(group, sequence_parallel, plan.sequence_dim)
    for name, styles in matches.items():
        module = work.get_submodule(name)
        for style in styles:
            module = style.apply(module, name, ctx)
        work = _put(work, name, module)
    for finish in ctx.finishers:
        finish(work)
    _check_ties(work, ctx)
    return Parallelized(work, group, sequence_parallel, ctx.vocab, ctx.sequence_parameters)


def _check_ties(model: nn.Module, ctx: ShardContext) -> None:
    """A parameter the plan split must not survive whole elsewhere (tied to a module the
    plan left alone: it would train apart from its shards)."""
    for name, param in model.named_parameters(remove_duplicate=False):
        seen = ctx.split.get(id(param))
        if seen is not None and seen.original is param:
            raise ValueError(f"{name} is tied to {seen.name}, which the plan splits as "
                             f"{seen.how}; give {name.rpartition('.')[0]} a style that "
                             f"splits it the same way")


def apply_tensor_parallel(model: nn.Module, tp_comm: Communicator, sequence_parallel: bool = False,
                          algorithm: str | None = None) -> TensorParallelLM:
    """This rank's tensor-parallel shard of ``model`` (disttrain's TransformerLM, left
    unchanged): a new module whose parameters are slices of ``model``'s. Every rank of
    ``tp_comm`` calls it with the same model (same seed). ``algorithm``: the collectives'
    algorithm (None: the communicator's default). It is :func:`parallelize` with
    :func:`~.transformer.transformer_lm_plan` and returns the module, which has its own
    loss (:class:`~.transformer.TensorParallelLM`)."""
    lm_parts(model)
    check_divisible(model, tp_comm.world_size)
    shard = parallelize(model, tp_comm, transformer_lm_plan(model),
                        sequence_parallel=sequence_parallel, algorithm=algorithm).module
    assert isinstance(shard, TensorParallelLM)
    return shard
