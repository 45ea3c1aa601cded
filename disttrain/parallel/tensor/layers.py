"""The tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding.

A linear layer ``Y = X A + b`` with ``A`` of shape ``in × out`` splits two ways (Megatron-LM,
Shoeybi et al. 2019, §3)::

    column-parallel: A = [A_0 | A_1 | ... ]    rank r computes Y_r = f(X) A_r + b_r
                     (output features split; each rank gets its columns of Y, no sum)
    row-parallel:    A = [A_0 ; A_1 ; ... ]    rank r computes X_r A_r, a partial sum;
                     Y = g(Σ_r X_r A_r) + b     (input features split: X arrives split)

Put a column-parallel layer before a row-parallel one and the split activation between them
never moves: the MLP (column, GELU, row) and attention (heads split by the column-parallel
QKV projection, merged back by the row-parallel output projection) each cost one
all-reduce forward (g) and one backward (f). With sequence parallelism f and g become the
all-gather / reduce-scatter pair of :mod:`.ops`.

Each layer is built from the ordinary module it replaces (``from_linear``, ``from_module``,
``from_embedding``): it keeps this rank's slice of the weights, in the layout the original
stored them (``nn.Linear``'s ``(out, in)``, or ``(in, out)`` for Hugging Face's ``Conv1D``:
``transposed``), and its ``tp_split`` says how the slices join back, so the full parameters
can be gathered back under their own names and shapes
(:func:`~disttrain.parallel.tensor.api.full_state_dict`). A split is ``"rows"``
(along dim 0) or ``"cols"`` (along dim 1), optionally ``/p`` for a tensor fused from ``p``
equal parts that are split one by one (``"rows/3"``, alias ``"qkv"``: the rows of each of
Q, K and V, so that every rank holds whole heads of each).

Where a layer's input comes from (``input``):

* ``"sequence"``: it enters the parallel region itself: f, or ḡ (gathering the sequence)
  with sequence parallelism;
* ``"whole"``: f in both cases (the input is whole on every rank even with sequence
  parallelism: the region was left before it, :func:`~.ops.join_sequence`);
* ``"entered"``: no communication: the layer shares its input with sibling layers (Llama's
  q/k/v, gate/up) and the region was entered once for all of them, at the norm before
  them (:class:`~.plan.EnterRegion`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.tensor.ops import (
    TPGroup,
    all_gather_sequence,
    copy_to_tp,
    reduce_from_tp,
    reduce_scatter_sequence,
)

Split = dict[str, str]  # parameter name → "rows", "cols" or "qkv" (optionally "/parts")
INPUTS = ("sequence", "whole", "entered")


def parse_split(how: str) -> tuple[int, int]:
    """(dim, parts) of a split: ``"rows"`` → (0, 1), ``"cols/3"`` → (1, 3), ``"qkv"`` →
    (0, 3)."""
    axis, _, parts = ("rows/3" if how == "qkv" else how).partition("/")
    if axis not in ("rows", "cols") or not (parts.isdigit() if parts else True):
        raise ValueError(f"unknown split {how!r}; use rows, cols or qkv, optionally /parts "
                         f"(rows/3)")
    return (0 if axis == "rows" else 1), int(parts or 1)


def shard(tensor: torch.Tensor, how: str, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``tensor`` (a copy) split ``size`` ways as ``how`` says."""
    dim, parts = parse_split(how)
    if parts == 1:
        return tensor.chunk(size, dim)[rank].clone()
    # p equal parts stacked along ``dim``: this rank's slice of each
    shape = tensor.shape
    split = tensor.unflatten(dim, (parts, shape[dim] // parts)).chunk(size, dim + 1)[rank]
    return split.flatten(dim, dim + 1).clone()


def unshard(shards: torch.Tensor, how: str) -> torch.Tensor:
    """The full tensor from every rank's slice stacked along a new dim 0 (rank order)."""
    dim, parts = parse_split(how)
    if parts == 1:
        return torch.cat(list(shards.unbind(0)), dim=dim)
    # (size, ..., parts·n, ...) → (..., parts, size·n, ...) → (..., parts·size·n, ...)
    per = shards.unflatten(dim + 1, (parts, shards.shape[dim + 1] // parts))
    return torch.cat(list(per.unbind(0)), dim=dim + 1).flatten(dim, dim + 1)


def linear_layout(module: nn.Module) -> bool | None:
    """False for an ``nn.Linear`` (weight ``(out, in)``), True for a layer that stores its
    weight transposed, ``(in, out)``, and computes ``x @ W + b`` (Hugging Face's ``Conv1D``:
    attributes ``nx``, ``nf``); None for anything else."""
    if isinstance(module, nn.Linear):
        return False
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape == (nx, nf):
        return True
    return None


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    """``module.<name>``, detached (a parameter every linear layer has)."""
    tensor = getattr(module, name)
    assert isinstance(tensor, torch.Tensor)
    return tensor.detach()


def _transposed_split(how: str, transposed: bool) -> str:
    """A split of the ``(out, in)`` layout said in the stored layout."""
    if not transposed:
        return how
    dim, parts = parse_split(how)
    return ("cols" if dim == 0 else "rows") + (f"/{parts}" if parts > 1 else "")


def _enter(x: torch.Tensor, layer: ColumnParallelLinear) -> torch.Tensor:
    if layer.input == "entered":
        return x
    if layer.sequence_parallel and layer.input == "sequence":
        return all_gather_sequence(x, layer.group, layer.seq_dim)
    return copy_to_tp(x, layer.group)


class ColumnParallelLinear(nn.Module):
    """``Y_r = f(X) A_r + b_r``: this rank's output features. The input is the same on
    every rank (f: identity forward, all-reduce backward) or, with sequence parallelism,
    this rank's part of the sequence, all-gathered first (ḡ); see ``input`` in the module
    docstring. ``split``: how the output features split, ``"rows"`` or ``"qkv"`` /
    ``"rows/p"`` for ``p`` fused parts (said in ``nn.Linear``'s layout whatever
    ``transposed``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup,
                 sequence_parallel: bool = False, split: str = "rows", *,
                 transposed: bool = False, input: str = "sequence", seq_dim: int = 0) -> None:
        super().__init__()
        if input not in INPUTS:
            raise ValueError(f"input must be one of {', '.join(INPUTS)}, got {input!r}")
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group, self.sequence_parallel = group, sequence_parallel
        self.transposed, self.input, self.seq_dim = transposed, input, seq_dim
        self.tp_split: Split = {"weight": _transposed_split(split, transposed), "bias": split}

    @classmethod
    def from_linear(cls, linear: nn.Module, group: TPGroup, sequence_parallel: bool = False,
                    split: str = "rows", *, input: str = "sequence",
                    seq_dim: int = 0) -> ColumnParallelLinear:
        """``split="qkv"``: ``linear`` stacks Q, K and V; each rank takes its heads of each.
        ``linear``: an ``nn.Linear`` or a ``Conv1D`` (:func:`linear_layout`)."""
        transposed = bool(linear_layout(linear))
        r, t = group.rank, group.size
        weight = shard(_tensor(linear, "weight"), _transposed_split(split, transposed), r, t)
        found = getattr(linear, "bias", None)
        bias = shard(found.detach(), split, r, t) if isinstance(found, torch.Tensor) else None
        return cls(weight, bias, group, sequence_parallel, split, transposed=transposed,
                   input=input, seq_dim=seq_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        return F.linear(_enter(x, self), weight, self.bias)


class RowParallelLinear(nn.Module):
    """``Y = g(Σ_r X_r A_r) + b``: the input arrives split along its features; the partial
    products are all-reduced (g) or, with sequence parallelism, reduce-scattered along the
    sequence (ḡ*). The bias is added once, after the sum (it is replicated)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup,
                 sequence_parallel: bool = False, *, transposed: bool = False,
                 seq_dim: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group, self.sequence_parallel = group, sequence_parallel
        self.transposed, self.seq_dim = transposed, seq_dim
        self.tp_split: Split = {"weight": "rows" if transposed else "cols"}

    @classmethod
    def from_linear(cls, linear: nn.Module, group: TPGroup, sequence_parallel: bool = False,
                    *, seq_dim: int = 0) -> RowParallelLinear:
        """``linear``: an ``nn.Linear`` or a ``Conv1D`` (:func:`linear_layout`)."""
        transposed = bool(linear_layout(linear))
        found = getattr(linear, "bias", None)
        bias = found.detach().clone() if isinstance(found, torch.Tensor) else None
        weight = shard(_tensor(linear, "weight"), "rows" if transposed else "cols", group.rank,
                       group.size)
        return cls(weight, bias, group, sequence_parallel, transposed=transposed,
                   seq_dim=seq_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.t() if self.transposed else self.weight)
        y = reduce_scatter_sequence(y, self.group, self.seq_dim) if self.sequence_parallel \
            else reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows (vocabulary entries): rank r holds entries
    ``vocab_start .. vocab_start + V/t − 1`` and looks up the tokens that fall there, zeros
    for the others; the sum over ranks (g, or ḡ* with sequence parallelism) is the full
    lookup. Token ids ``(T, B)`` give ``(T, B, H)`` (``(T/t, B, H)`` with sequence
    parallelism; ``seq_dim`` says where the sequence is). ``whole_output``: g even with
    sequence parallelism, for models whose own code needs the whole sequence after the
    embedding (they split it later, :func:`~.ops.split_sequence`). ``padding_idx``: the
    vocabulary entry whose row gets no gradient, as in ``nn.Embedding``."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: TPGroup,
                 sequence_parallel: bool = False, *, whole_output: bool = False,
                 seq_dim: int = 0, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start = vocab_start
        self.group, self.sequence_parallel = group, sequence_parallel
        self.whole_output, self.seq_dim = whole_output, seq_dim
        local_pad = None if padding_idx is None else padding_idx - vocab_start
        self.padding_idx = local_pad if local_pad is not None and (
            0 <= local_pad < weight.shape[0]) else None  # a row of this shard, or none
        self.tp_split: Split = {"weight": "rows"}

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: TPGroup,
                       sequence_parallel: bool = False, *, whole_output: bool = False,
                       seq_dim: int = 0) -> VocabParallelEmbedding:
        per = embedding.num_embeddings // group.size
        return cls(shard(embedding.weight.detach(), "rows", group.rank, group.size),
                   group.rank * per, group, sequence_parallel, whole_output=whole_output,
                   seq_dim=seq_dim, padding_idx=embedding.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        local.masked_fill_(outside, 0)
        partial = F.embedding(local, self.weight, self.padding_idx).masked_fill_(
            outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel and not self.whole_output:
            return reduce_scatter_sequence(partial, self.group, self.seq_dim)
        return reduce_from_tp(partial, self.group)


# ---------------------------------------------------------------- whole state dicts
def full_state_dict(model: nn.Module, group: TPGroup) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict (the original's keys and shapes) on every rank of
    ``group``: each split parameter is all-gathered and joined (a collective; a tied one
    once); persistent buffers as they are."""
    state: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        split: dict[str, str] = getattr(module, "tp_split", {})
        for name, param in module.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            how = split.get(name)
            if how is None:
                state[key] = param.detach().clone()
            else:
                if id(param) not in gathered:
                    gathered[id(param)] = unshard(group.all_gather(param.detach().unsqueeze(0)),
                                                  how)
                state[key] = gathered[id(param)]
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buffer in module.named_buffers(recurse=False):
            if name not in skip:
                state[f"{prefix}.{name}" if prefix else name] = buffer.detach().clone()
    return state


def load_full_state_dict(model: nn.Module, group: TPGroup,
                         state: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's slice of every tensor of an unsplit ``state`` into ``model``."""
    with torch.no_grad():
        for prefix, module in model.named_modules(remove_duplicate=False):
            split: dict[str, str] = getattr(module, "tp_split", {})
            for name, tensor in [*module.named_parameters(recurse=False),
                                 *module.named_buffers(recurse=False)]:
                key = f"{prefix}.{name}" if prefix else name
                if key not in state:
                    if name in module._parameters:
                        raise ValueError(f"the state dict has no {key!r}; load one saved "
                                         f"from this model (full_state_dict)")
                    continue  # a non-persistent buffer
                how = split.get(name)
                full = state[key]
                tensor.copy_(full if how is None else shard(full, how, group.rank, group.size))
