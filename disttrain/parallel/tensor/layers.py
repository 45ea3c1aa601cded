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

Each layer is built from the ordinary module it replaces (``from_linear``,
``from_embedding``): it keeps this rank's slice of the weights, and its ``tp_split`` says how
the slices join back (``"rows"``: along dim 0, ``"cols"``: along dim 1, ``"qkv"``: the rows
of each of Q, K and V), so the full parameters can be gathered back
(:func:`~disttrain.parallel.tensor.transformer.full_state_dict`).
"""

from __future__ import annotations

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

Split = dict[str, str]  # parameter name → "rows", "cols" or "qkv"


def shard(tensor: torch.Tensor, how: str, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``tensor`` (a copy) split ``size`` ways as ``how`` says."""
    if how == "rows":
        return tensor.chunk(size, 0)[rank].clone()
    if how == "cols":
        return tensor.chunk(size, 1)[rank].clone()
    if how == "qkv":  # [Q; K; V] stacked along dim 0: this rank's heads of each
        parts = tensor.view(3, tensor.shape[0] // 3, *tensor.shape[1:]).chunk(size, 1)[rank]
        return parts.reshape(-1, *tensor.shape[1:]).clone()
    raise ValueError(f"unknown split {how!r}; use rows, cols or qkv")


def unshard(shards: torch.Tensor, how: str) -> torch.Tensor:
    """The full tensor from every rank's slice stacked along a new dim 0 (rank order)."""
    size = shards.shape[0]
    if how == "rows":
        return shards.reshape(-1, *shards.shape[2:])
    if how == "cols":
        return torch.cat(list(shards.unbind(0)), dim=1)
    if how == "qkv":
        per = shards.view(size, 3, shards.shape[1] // 3, *shards.shape[2:])
        return per.transpose(0, 1).reshape(-1, *shards.shape[2:])
    raise ValueError(f"unknown split {how!r}; use rows, cols or qkv")


class ColumnParallelLinear(nn.Module):
    """``Y_r = f(X) A_r + b_r``: this rank's output features. The input is the same on
    every rank (f: identity forward, all-reduce backward) or, with sequence parallelism,
    this rank's part of the sequence, all-gathered first (ḡ)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup,
                 sequence_parallel: bool = False, split: str = "rows") -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tp_split: Split = {"weight": split, "bias": split}

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: TPGroup, sequence_parallel: bool = False,
                    split: str = "rows") -> ColumnParallelLinear:
        """``split="qkv"``: ``linear`` stacks Q, K and V; each rank takes its heads of each."""
        r, t = group.rank, group.size
        bias = shard(linear.bias.detach(), split, r, t) if linear.bias is not None else None
        return cls(shard(linear.weight.detach(), split, r, t), bias, group, sequence_parallel,
                   split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = all_gather_sequence(x, self.group) if self.sequence_parallel else copy_to_tp(
            x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``Y = g(Σ_r X_r A_r) + b``: the input arrives split along its features; the partial
    products are all-reduced (g) or, with sequence parallelism, reduce-scattered along the
    sequence (ḡ*). The bias is added once, after the sum (it is replicated)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tp_split: Split = {"weight": "cols"}

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: TPGroup,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(shard(linear.weight.detach(), "cols", group.rank, group.size), bias, group,
                   sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = reduce_scatter_sequence(y, self.group) if self.sequence_parallel else (
            reduce_from_tp(y, self.group))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows (vocabulary entries): rank r holds entries
    ``vocab_start .. vocab_start + V/t − 1`` and looks up the tokens that fall there, zeros
    for the others; the sum over ranks (g, or ḡ* with sequence parallelism) is the full
    lookup. Takes token ids ``(T, B)`` and returns ``(T, B, H)`` (``(T/t, B, H)`` with
    sequence parallelism)."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: TPGroup,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start = vocab_start
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tp_split: Split = {"weight": "rows"}

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: TPGroup,
                       sequence_parallel: bool = False) -> VocabParallelEmbedding:
        per = embedding.num_embeddings // group.size
        return cls(shard(embedding.weight.detach(), "rows", group.rank, group.size),
                   group.rank * per, group, sequence_parallel)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        local.masked_fill_(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, self.group)
        return reduce_from_tp(partial, self.group)
