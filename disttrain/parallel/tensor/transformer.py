"""disttrain's TransformerLM split over a tensor-parallel group: its plan,
:func:`transformer_lm_plan`, and the modules it puts in place
(:func:`~.api.apply_tensor_parallel` is :func:`~.api.parallelize` with it).

The model is recognised by its structure (:func:`lm_parts`), not imported: ``parallel``
sits below ``train`` and does not reach up into it.

Every piece of :class:`~disttrain.train.transformer.TransformerLM` is replaced by its
tensor-parallel counterpart, holding this rank's slice of the same weights, under the same
parameter names (so the full model's state dict can be gathered back)::

    Embeddings    tokens: vocabulary-parallel (g)      positions: replicated
    Block × L     norm1 → attention: QKV column-parallel by heads (f), out row-parallel (g)
                  norm2 → MLP: fc1 column-parallel (f), GELU, fc2 row-parallel (g)
    LayerNorm     replicated
    Linear head   column-parallel over the vocabulary (f): logits stay split, and the loss
                  is the vocabulary-parallel cross-entropy (:meth:`TensorParallelLM.loss`)

The generic styles (:mod:`.plan`) split the linear layers and mark the norms; the four
styles here know the TransformerLM's own modules: its embedding (positions, and the switch
to sequence-first), its block and attention (sequence-first, on this rank's heads) and its
head (batch-first logits again), and the model itself becomes a :class:`TensorParallelLM`.

Inside, activations are sequence-first ``(T, B, H)``: sequence parallelism shards them along
the sequence, and rank r's slice of dim 0 is one contiguous block for the collectives. The
model takes ``(B, T)`` tokens like the original and returns this rank's logits as a
``(B, T, V/t)`` view.

With ``sequence_parallel=True`` the LayerNorms, the residual stream, the row-parallel
biases and the position embedding work on ``T/t`` positions per rank (Korthikanti et al.
2022): their activations shrink t-fold, and their replicated parameters (``sequence_parallel
_parameters``) see only this rank's positions, so their gradients are partial sums that
:meth:`TensorParallelLM.reduce_sequence_parallel_grads` all-reduces over the group after
backward (one flat all-reduce). Without sequence parallelism every rank computes those
regions on the whole sequence and their gradients agree without communication.

The LM has no dropout; a dropout inside the sequence-parallel region would need a
different random stream per TP rank, and one shared by the TP ranks in the replicated
regions (Megatron's RNG tracker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_state_dict,
)
from disttrain.parallel.tensor.ops import (
    TPGroup,
    check_sequence,
    gather_vocab,
    reduce_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from disttrain.parallel.tensor.plan import (
    ColumnWise,
    Plan,
    RowWise,
    SequenceParallel,
    ShardContext,
    Style,
    Styles,
    record_vocab,
)

__all__ = [
    "ParallelAttention", "ParallelBlock", "ParallelEmbeddings", "ParallelHead",
    "TensorParallelLM", "check_divisible", "check_sequence",
    "full_state_dict", "lm_parts", "lm_shape", "reduce_sequence_parallel_grads",
    "sequence_parallel_parameters", "transformer_lm_plan",
]


class ParallelEmbeddings(nn.Module):
    """Token embedding (vocabulary-parallel) plus the replicated position embedding;
    ``(B, T)`` tokens → ``(T, B, H)``, or ``(T/t, B, H)`` with sequence parallelism."""

    def __init__(self, full: Any, group: TPGroup, sequence_parallel: bool) -> None:
        super().__init__()
        self.max_len = full.max_len
        self.tokens = VocabParallelEmbedding.from_embedding(full.tokens, group,
                                                            sequence_parallel)
        self.positions = full.positions  # the model's copy: its device and dtype
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[-1]
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens is longer than max_len={self.max_len}")
        start, end = 0, length
        if self.sequence_parallel:
            check_sequence(length, self.group.size)
            per = length // self.group.size
            start, end = self.group.rank * per, (self.group.rank + 1) * per
        x = self.tokens(tokens.t())
        return x + self.positions.weight[start:end].unsqueeze(1)


class ParallelAttention(nn.Module):
    """Causal self-attention, sequence-first, on this rank's ``n_heads / t`` heads; its
    ``qkv`` and ``out`` are split by the plan (column-wise by heads, row-wise)."""

    def __init__(self, full: Any, tp: int) -> None:
        super().__init__()
        self.n_heads = full.n_heads // tp
        self.qkv, self.out = full.qkv, full.out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (T, B, 3·H/t), all T positions
        length, batch, width = qkv.shape
        q, k, v = (t.view(length, batch, self.n_heads, -1).permute(1, 2, 0, 3)
                   for t in qkv.split(width // 3, dim=-1))  # (B, heads, T, D/heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.permute(2, 0, 1, 3).reshape(length, batch, width // 3))


class ParallelBlock(nn.Module):
    """A pre-norm block (the original's modules, split by the plan)."""

    def __init__(self, full: Any) -> None:
        super().__init__()
        self.norm1, self.attention = full.norm1, full.attention
        self.norm2, self.mlp = full.norm2, full.mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ParallelHead(ColumnParallelLinear):
    """The vocabulary projection, column-parallel: ``(T, B, H)`` → this rank's logits as a
    ``(B, T, V/t)`` view (batch-first again, like the original model's output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).transpose(0, 1)


class TensorParallelLM(nn.Sequential):
    """This rank's shard of a TransformerLM (build it with
    :func:`~.api.apply_tensor_parallel`).

    Train with ``model.loss(model(tokens), targets)``: the logits never leave their rank.
    """

    def __init__(self, layers: list[nn.Module], group: TPGroup, sequence_parallel: bool,
                 vocab_size: int) -> None:
        super().__init__(*layers)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_size = vocab_size
        self.vocab_start = group.rank * (vocab_size // group.size)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every token, from this rank's logits."""
        return vocab_parallel_cross_entropy(logits, targets, self.group,
                                            self.vocab_start).mean()

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's logits joined (for evaluation; a collective)."""
        return gather_vocab(logits, self.group)

    def sequence_parallel_parameters(self) -> list[nn.Parameter]:
        """Replicated parameters used on this rank's part of the sequence only (empty
        without sequence parallelism): see :func:`sequence_parallel_parameters`."""
        return sequence_parallel_parameters(self) if self.sequence_parallel else []

    def reduce_sequence_parallel_grads(self) -> None:
        """Sum the gradients of :meth:`sequence_parallel_parameters` over the group (one
        flat all-reduce; call after backward, before the optimizer)."""
        reduce_sequence_parallel_grads(self.sequence_parallel_parameters(), self.group)


def sequence_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The replicated parameters of ``module`` (a sequence-parallel TransformerLM shard, or
    a pipeline stage of one) that work on this rank's positions only: LayerNorms,
    row-parallel biases, the position embedding (any model:
    :meth:`~.api.Parallelized.sequence_parallel_parameters`)."""
    found: list[nn.Parameter] = []
    for sub in module.modules():
        if isinstance(sub, nn.LayerNorm):
            found += [p for p in (sub.weight, sub.bias) if p is not None]
        elif isinstance(sub, RowParallelLinear) and sub.bias is not None:
            found.append(sub.bias)
        elif isinstance(sub, ParallelEmbeddings):
            found += list(sub.positions.parameters())
    return found


# ---------------------------------------------------------------- the TransformerLM's styles
@dataclass(frozen=True)
class LMModel(Style):
    """The model (``""``): a :class:`TensorParallelLM` of the same layers."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        head = lm_parts(module)[3]
        return TensorParallelLM(list(module.children()), ctx.group, ctx.sequence_parallel,
                                head.out_features)


@dataclass(frozen=True)
class LMEmbeddings(Style):
    """Its ``Embeddings``: vocabulary-parallel tokens, this rank's positions with SP."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        layer = ParallelEmbeddings(module, ctx.group, ctx.sequence_parallel)
        tokens: Any = module.tokens
        ctx.adopt(f"{name}.tokens.weight", tokens.weight, "rows", layer.tokens, "weight")
        ctx.mark_sequence_parallel(*layer.positions.parameters())
        return layer


@dataclass(frozen=True)
class LMBlock(Style):
    """A ``Block``, sequence-first (its modules are split by the other entries)."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        return ParallelBlock(module)


@dataclass(frozen=True)
class LMAttention(Style):
    """Its attention, on this rank's heads (the original reads the width from its input)."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        return ParallelAttention(module, ctx.group.size)


@dataclass(frozen=True)
class LMHead(Style):
    """Its vocabulary projection: column-parallel, batch-first logits ``(B, T, V/t)``."""

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        assert isinstance(module, nn.Linear)
        layer = ParallelHead.from_linear(module, ctx.group, ctx.sequence_parallel)
        ctx.adopt(f"{name}.weight", module.weight, "rows", layer, "weight")
        record_vocab(layer, ctx)
        return layer


def transformer_lm_plan(model: nn.Module) -> Plan:
    """The plan of a TransformerLM of ``model``'s shape (sequence-first inside)."""
    embeddings, blocks, _, _ = lm_parts(model)
    head_dim = embeddings.tokens.embedding_dim // blocks[0].attention.n_heads
    layers = len(blocks)
    styles: dict[str, Styles] = {"": LMModel(), "0": LMEmbeddings()}
    styles.update({str(i): LMBlock() for i in range(1, layers + 1)})
    styles.update({
        "*.attention": LMAttention(),
        "*.attention.qkv": ColumnWise(parts=3, unit=head_dim),
        "*.attention.out": RowWise(unit=head_dim),
        "*.mlp.0": ColumnWise(),
        "*.mlp.2": RowWise(),
        "*.norm1": SequenceParallel(),
        "*.norm2": SequenceParallel(),
        str(layers + 1): SequenceParallel(),
        str(layers + 2): LMHead(),
    })
    return Plan(styles, sequence_dim=0)


def lm_parts(model: nn.Module) -> tuple[Any, list[Any], nn.LayerNorm, nn.Linear]:
    """(embeddings, blocks, final norm, head) of a TransformerLM-shaped ``nn.Sequential``:
    ``Embeddings`` (``tokens``, ``positions``), blocks (``norm1``, ``attention`` with
    ``qkv``, ``out``, ``n_heads``; ``norm2``, ``mlp`` = Linear, activation, Linear), a
    LayerNorm and a Linear; a one-line ValueError otherwise."""
    layers = list(model) if isinstance(model, nn.Sequential) else []
    ok = len(layers) >= 4 and isinstance(layers[-2], nn.LayerNorm) and isinstance(
        layers[-1], nn.Linear) and all(isinstance(getattr(layers[0], n, None), nn.Embedding)
                                       for n in ("tokens", "positions"))
    for block in layers[1:-2] if ok else ():
        attention, mlp = getattr(block, "attention", None), getattr(block, "mlp", None)
        ok = ok and all(isinstance(getattr(block, n, None), nn.LayerNorm)
                        for n in ("norm1", "norm2")) and isinstance(
            getattr(attention, "qkv", None), nn.Linear) and isinstance(
            getattr(attention, "out", None), nn.Linear) and isinstance(
            getattr(attention, "n_heads", None), int) and isinstance(mlp, nn.Sequential) and (
            len(mlp) == 3 and isinstance(mlp[0], nn.Linear) and isinstance(mlp[2], nn.Linear))
    if not ok:
        raise ValueError(f"tensor parallelism splits disttrain's TransformerLM (attention "
                         f"heads, MLP, vocabulary); got {type(model).__name__}: use --model "
                         f"transformer")
    norm, head = layers[-2], layers[-1]
    assert isinstance(norm, nn.LayerNorm) and isinstance(head, nn.Linear)
    return layers[0], layers[1:-2], norm, head


def check_divisible(model: nn.Module, tp: int) -> None:
    """One-line ValueError naming the first dimension that does not divide by ``tp``."""
    embeddings, blocks, _, _ = lm_parts(model)
    d_model = embeddings.tokens.embedding_dim
    heads = blocks[0].attention.n_heads
    dims = (("n_heads", heads), ("d_model", d_model), ("hidden 4*d_model", 4 * d_model),
            ("vocab_size", embeddings.tokens.num_embeddings))
    for name, value in dims:
        if value % tp:
            raise ValueError(f"tensor parallelism over {tp} ranks splits {name}={value}, "
                             f"which does not divide by {tp}; use a TP size that divides "
                             f"it or change the model")


def lm_shape(model: nn.Module) -> dict[str, int]:
    """The TransformerLM constructor arguments of ``model`` (the original or a shard:
    sizes are read from the unsplit modules and the shard's group)."""
    if isinstance(model, TensorParallelLM):
        t = model.group.size
        layers: list[Any] = list(model)
        embeddings, blocks = layers[0], layers[1:-2]
        return {"vocab_size": model.vocab_size, "max_len": embeddings.max_len,
                "d_model": embeddings.positions.embedding_dim,
                "n_heads": blocks[0].attention.n_heads * t, "n_layers": len(blocks)}
    embeddings, blocks, _, head = lm_parts(model)
    return {"vocab_size": head.out_features, "max_len": embeddings.max_len,
            "d_model": embeddings.tokens.embedding_dim, "n_heads": blocks[0].attention.n_heads,
            "n_layers": len(blocks)}
