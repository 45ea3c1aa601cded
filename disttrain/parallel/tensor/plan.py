"""Tensor-parallel plans: which module of a model is split how, as data.

A :class:`Plan` maps module-name patterns (``fnmatch``: ``"transformer.h.*.attn.c_attn"``;
``""`` is the model itself) to a style, or a tuple of styles, in the spirit of torch's
``parallelize_module`` plans; :func:`~disttrain.parallel.tensor.api.parallelize`
applies one. The styles, each on disttrain's own f / g operators (:mod:`.ops`)::

    ColumnWise(parts, unit, input)  nn.Linear or Conv1D split by output features; ``parts``
                                    fused blocks (GPT-2's c_attn: q, k, v) split one by one;
                                    ``unit`` the features that stay together (a head)
    RowWise(unit)                   split by input features; the partial sums are reduced
    VocabEmbedding()                nn.Embedding split by vocabulary rows
    VocabHead(input)                the LM head, column-wise over the vocabulary: logits
                                    stay split and the loss is vocabulary-parallel
    SequenceParallel()              norms and dropouts between the blocks: with sequence
                                    parallelism they see this rank's positions only, and
                                    their replicated parameters' gradients are summed
    EnterRegion()                   the module's output enters the parallel region once
                                    (f, or ḡ with SP) for the column-wise layers after it
    SplitSequence() / JoinSequence() where a model's activations enter and leave the
                                    sequence-parallel region (SP only; no-ops without)
    LocalHeads(attributes)          an attention module's head counts and widths, divided
                                    by the degree (Hugging Face attention reads them)
    CausalLMLoss()                  (on ``""``) a transformers model's ``labels=`` loss
                                    made vocabulary-parallel

A plan that does not fit the model is a one-line ValueError naming the module and the
numbers (:func:`check_units`). The built-in plans are in :mod:`.plans`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.tensor.layers import (
    INPUTS,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    linear_layout,
)
from disttrain.parallel.tensor.ops import (
    TPGroup,
    all_gather_sequence,
    copy_to_tp,
    join_sequence,
    split_sequence,
    vocab_parallel_loss,
)


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary split of an LM head: ``size`` entries, this rank's from ``start``."""

    size: int
    start: int


@dataclass(frozen=True, eq=False)
class Adopted:
    """A model parameter split by the plan: where, how, and the shard that replaced it
    (the original is kept so that its id is not reused while the plan is applied)."""

    name: str
    how: str
    original: torch.Tensor
    shard: nn.Parameter


@dataclass(eq=False)
class ShardContext:
    """What one :func:`~.api.parallelize` call shares with its styles: the group,
    the options, and what they record (sequence-parallel parameters, the vocabulary split,
    which original parameters were split how, so tied ones stay tied)."""

    group: TPGroup
    sequence_parallel: bool
    sequence_dim: int
    vocab: VocabShard | None = None
    sequence_parameters: list[nn.Parameter] = field(default_factory=list)
    split: dict[int, Adopted] = field(default_factory=dict)
    finishers: list[Callable[[nn.Module], None]] = field(default_factory=list)

    def mark_sequence_parallel(self, *params: nn.Parameter | None) -> None:
        """Replicated parameters used on this rank's positions only (SP only)."""
        if self.sequence_parallel:
            self.sequence_parameters += [p for p in params if p is not None]

    def adopt(self, name: str, original: torch.Tensor, how: str, layer: nn.Module,
              attr: str) -> None:
        """Record that ``original`` (the model's parameter, at ``name``) became
        ``layer.<attr>`` split as ``how``; a parameter tied to one already split the same
        way (GPT-2's lm_head and wte) becomes that very shard."""
        seen = self.split.get(id(original))
        if seen is None:
            self.split[id(original)] = Adopted(name, how, original, getattr(layer, attr))
        elif seen.how != how:
            raise ValueError(f"{name} is tied to {seen.name}, split as {seen.how}; the plan "
                             f"splits it as {how}: give both the same split")
        else:
            setattr(layer, attr, seen.shard)


class Style:
    """How one module is split: ``apply`` returns the module that takes its place (or the
    module itself, changed)."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        raise NotImplementedError


def check_units(name: str, what: str, features: int, tp: int, parts: int = 1,
                unit: int = 1) -> None:
    """One-line ValueError unless ``features`` = parts × units × unit with the units
    dividing by ``tp`` (whole heads per rank)."""
    per = features // parts if features % parts == 0 else 0
    if not per or per % unit:
        raise ValueError(f"{name}: its {features} {what} are not {parts} part(s) of whole "
                         f"units of {unit}; fix the plan's parts/unit for this module")
    units = per // unit
    if units % tp:
        said = f"{units} heads of {unit}" if unit > 1 else f"{units}"
        fused = f"{parts} parts of " if parts > 1 else ""
        raise ValueError(f"{name}: its {features} {what} ({fused}{said}) do not split over "
                         f"{tp} tensor-parallel ranks; use a tensor-parallel size that "
                         f"divides {units} or change the model")


def _linear(module: nn.Module, name: str, style: str) -> bool:
    transposed = linear_layout(module)
    if transposed is None:
        raise ValueError(f"{style} splits an nn.Linear or a Conv1D; {name} is a "
                         f"{type(module).__name__}: fix the plan's pattern for it")
    return transposed


def _check_input(input: str) -> None:
    if input not in INPUTS:
        raise ValueError(f"input must be one of {', '.join(INPUTS)}, got {input!r}")


@dataclass(frozen=True)
class ColumnWise(Style):
    """Split by output features (see the module docstring); ``input`` as in
    :mod:`.layers`: ``"sequence"``, ``"whole"`` or ``"entered"``."""

    parts: int = 1
    unit: int = 1
    input: str = "sequence"

    def __post_init__(self) -> None:
        if self.parts < 1 or self.unit < 1:
            raise ValueError(f"ColumnWise needs parts ≥ 1 and unit ≥ 1, got {self.parts}, "
                             f"{self.unit}")
        _check_input(self.input)

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        transposed = _linear(module, name, "ColumnWise")
        weight = module.weight
        assert isinstance(weight, nn.Parameter)
        out = weight.shape[1] if transposed else weight.shape[0]
        check_units(name, "output features", out, ctx.group.size, self.parts, self.unit)
        split = "rows" if self.parts == 1 else f"rows/{self.parts}"
        layer = ColumnParallelLinear.from_linear(module, ctx.group, ctx.sequence_parallel,
                                                 split, input=self.input,
                                                 seq_dim=ctx.sequence_dim)
        ctx.adopt(f"{name}.weight", weight, layer.tp_split["weight"], layer, "weight")
        return layer


@dataclass(frozen=True)
class RowWise(Style):
    """Split by input features; ``unit``: input features that stay together (a head)."""

    unit: int = 1

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        transposed = _linear(module, name, "RowWise")
        weight = module.weight
        assert isinstance(weight, nn.Parameter)
        features = weight.shape[0] if transposed else weight.shape[1]
        check_units(name, "input features", features, ctx.group.size, 1, self.unit)
        layer = RowParallelLinear.from_linear(module, ctx.group, ctx.sequence_parallel,
                                              seq_dim=ctx.sequence_dim)
        ctx.adopt(f"{name}.weight", weight, layer.tp_split["weight"], layer, "weight")
        ctx.mark_sequence_parallel(layer.bias)  # added after ḡ*: on this rank's positions
        return layer


@dataclass(frozen=True)
class VocabEmbedding(Style):
    """An ``nn.Embedding`` split by vocabulary rows. Its output is whole (g) even with
    sequence parallelism unless ``sequence_output`` (ḡ*: only for a model that adds
    nothing needing the whole sequence after it; disttrain's TransformerLM does that in
    its own embedding module)."""

    sequence_output: bool = False

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"VocabEmbedding splits an nn.Embedding; {name} is a "
                             f"{type(module).__name__}: fix the plan's pattern for it")
        check_units(name, "vocabulary entries", module.num_embeddings, ctx.group.size)
        layer = VocabParallelEmbedding.from_embedding(
            module, ctx.group, ctx.sequence_parallel, whole_output=not self.sequence_output,
            seq_dim=ctx.sequence_dim)
        ctx.adopt(f"{name}.weight", module.weight, "rows", layer, "weight")
        return layer


@dataclass(frozen=True)
class VocabHead(Style):
    """The LM head (``nn.Linear(H, V)``), column-wise over the vocabulary: this rank's
    ``V/t`` logits, never gathered in training; the loss is
    :func:`~.ops.vocab_parallel_loss`. ``input`` as for :class:`ColumnWise`."""

    input: str = "sequence"

    def __post_init__(self) -> None:
        _check_input(self.input)

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        layer = ColumnWise(input=self.input).apply(module, name, ctx)
        record_vocab(layer, ctx)
        return layer


def record_vocab(layer: nn.Module, ctx: ShardContext) -> None:
    """Note the head's vocabulary split for the loss (one head per model)."""
    if ctx.vocab is not None:
        raise ValueError("the plan has two vocabulary-parallel heads; give VocabHead to "
                         "one module")
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    per = weight.shape[1] if getattr(layer, "transposed", False) else weight.shape[0]
    ctx.vocab = VocabShard(per * ctx.group.size, ctx.group.rank * per)


@dataclass(frozen=True)
class SequenceParallel(Style):
    """A module that works position by position (LayerNorm, RMSNorm, dropout): with
    sequence parallelism it runs on this rank's positions and its replicated parameters'
    gradients are partial sums, summed over the group after backward
    (:meth:`~.api.Parallelized.reduce_sequence_parallel_grads`)."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        ctx.mark_sequence_parallel(*module.parameters())
        return module


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any],
                 fn: Callable[[torch.Tensor], torch.Tensor], name: str
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``fn`` applied to a module's first input: its first positional argument, or
    ``hidden_states=`` (how Hugging Face layers are called)."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise ValueError(f"{name} was called without a positional input or hidden_states=; "
                     f"its input cannot be split along the sequence")


@dataclass(frozen=True)
class SplitSequence(Style):
    """With sequence parallelism, the module's first input (whole on every rank) is split
    to this rank's positions (:func:`~.ops.split_sequence`): the start of the
    sequence-parallel region. Nothing without."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        if ctx.sequence_parallel:
            group, dim = ctx.group, ctx.sequence_dim

            def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
                return _first_input(args, kwargs, lambda x: split_sequence(x, group, dim),
                                    name)

            module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


@dataclass(frozen=True)
class JoinSequence(Style):
    """With sequence parallelism, the module's output is joined to the whole sequence on
    every rank (:func:`~.ops.join_sequence`): the end of the region. Nothing without."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        if ctx.sequence_parallel:
            group, dim = ctx.group, ctx.sequence_dim
            module.register_forward_hook(lambda _, __, out: join_sequence(out, group, dim))
        return module


@dataclass(frozen=True)
class EnterRegion(Style):
    """The module's output enters the tensor-parallel region: f (identity forward,
    all-reduce backward), or ḡ (all-gather the sequence) with sequence parallelism; the
    column-wise layers that share it take ``input="entered"``. One f for q, k and v
    instead of three."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        group, dim, sp = ctx.group, ctx.sequence_dim, ctx.sequence_parallel

        def enter(_: nn.Module, __: Any, out: torch.Tensor) -> torch.Tensor:
            return all_gather_sequence(out, group, dim) if sp else copy_to_tp(out, group)

        module.register_forward_hook(enter)
        return module


@dataclass(frozen=True)
class LocalHeads(Style):
    """Divide an attention module's integer ``attributes`` (head counts, widths) by the
    degree: it then reads this rank's share. ``optional``: attributes divided where the
    module has them (they vary between versions of a library)."""

    attributes: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        t = ctx.group.size
        for attr in (*self.attributes, *(a for a in self.optional if hasattr(module, a))):
            value = getattr(module, attr, None)
            if not isinstance(value, int):
                raise ValueError(f"LocalHeads: {name} has no integer attribute {attr!r} "
                                 f"({type(module).__name__}); fix the plan's attributes")
            if value % t:
                raise ValueError(f"{name}.{attr}={value} does not split over {t} "
                                 f"tensor-parallel ranks; use a tensor-parallel size that "
                                 f"divides {value}")
            setattr(module, attr, value // t)
        return module


@dataclass(frozen=True)
class CausalLMLoss(Style):
    """On ``""``, a Hugging Face causal LM: ``model(input_ids, labels=...)``'s loss is
    computed from the split logits (labels shifted, -100 ignored, as transformers does)."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        if not hasattr(type(module), "loss_function"):
            raise ValueError(f"CausalLMLoss applies to a transformers model (with a "
                             f"loss_function); {name or 'the model'} is a "
                             f"{type(module).__name__}")

        def install(root: nn.Module) -> None:
            if ctx.vocab is None:
                raise ValueError("CausalLMLoss needs a VocabHead in the plan (the loss of "
                                 "split logits)")
            setattr(root, "loss_function", CausalLMLossFunction(ctx.group, ctx.vocab))  # noqa: B010

        ctx.finishers.append(install)
        return module


class CausalLMLossFunction:
    """transformers' ``ForCausalLMLoss`` on this rank's logits ``(B, T, V/t)``: labels
    shifted left (or ``shift_labels``), ``ignore_index`` skipped, the mean over the rest
    or the sum over ``num_items_in_batch``; the same value on every rank of the group.
    Float64 logits stay float64 (transformers' own casts them to float32)."""

    def __init__(self, group: TPGroup, vocab: VocabShard) -> None:
        self.group, self.vocab = group, vocab

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor,
                 vocab_size: int | None = None,
                 num_items_in_batch: torch.Tensor | int | None = None,
                 ignore_index: int = -100, shift_labels: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return vocab_parallel_loss(logits, shift_labels.to(logits.device), self.group,
                                   self.vocab.start, ignore_index, num_items_in_batch)


Styles = Style | tuple[Style, ...]


@dataclass(frozen=True)
class Plan:
    """Module-name patterns → styles, and where the activations' sequence dimension is
    (1: batch-first ``(B, T, H)``, as Hugging Face's; 0: sequence-first)."""

    styles: Mapping[str, Styles]
    sequence_dim: int = 1

    def __post_init__(self) -> None:
        if self.sequence_dim not in (0, 1):
            raise ValueError(f"sequence_dim must be 0 or 1, got {self.sequence_dim}")
        for pattern, styles in self.styles.items():
            for style in styles if isinstance(styles, tuple) else (styles,):
                if not isinstance(style, Style):
                    raise ValueError(f"plan entry {pattern!r}: {style!r} is not a style; "
                                     f"use ColumnWise(), RowWise(), ... (see plan.py)")

    def styles_of(self, pattern: str) -> tuple[Style, ...]:
        styles = self.styles[pattern]
        return styles if isinstance(styles, tuple) else (styles,)
