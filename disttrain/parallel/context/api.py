"""disttrain's TransformerLM over a context-parallel group: :func:`apply_context_parallel`
and the modules it puts in place.

Only two things in a transformer look across positions, so only two change: the position
embedding (each rank adds the embedding of its tokens' true positions, not 0 .. T/cp − 1)
and the attention (each rank's queries need every earlier key: ring or Ulysses). Norms,
MLPs, the head and the loss work token by token on this rank's tokens as they are::

    Embeddings    tokens: as they are      positions: this rank's zig-zag positions
    Block × L     attention: QKV and out projections as they are, the attention itself
                  over the cp group (ring: :mod:`.ring`; Ulysses: :mod:`.ulysses`)
                  norms, MLP: as they are
    LayerNorm, Linear head: as they are, on this rank's T/cp tokens

The model returned shares every parameter (and its name) with the one passed in: its state
dict is the original model's. Every parameter is replicated over the group and sees only
this rank's tokens, so after backward each gradient is a partial sum that
:meth:`ContextParallelLM.reduce_context_parallel_grads` adds up over the group (one flat
all-reduce, as sequence parallelism does for its norms). For the sum to be the gradient of
the whole sequence's mean loss, :meth:`ContextParallelLM.loss` is this rank's share of it:
the mean over its tokens divided by cp (every rank holds T/cp of them).

A tensor-parallel shard (:func:`~disttrain.parallel.tensor.apply_tensor_parallel`, the
composer applies tp before cp) works alike: its embeddings and attention are sequence-first
and hold this rank's heads; its vocabulary-parallel loss is divided by cp; with sequence
parallelism the positions are this tp rank's slice of this cp rank's. Its own methods
(``full_logits``, ``reduce_sequence_parallel_grads``) still apply to the shared parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.context.layout import natural_order, positions
from disttrain.parallel.context.ring import ring_attention, ring_neighbours
from disttrain.parallel.context.ulysses import ulysses_attention
from disttrain.parallel.mixed_precision import at_least_fp32

__all__ = ["VARIANTS", "ContextParallelConfig", "ContextParallelLM", "apply_context_parallel",
           "sum_gradients"]

VARIANTS = ("ring", "ulysses")
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ContextParallelConfig:
    """How attention crosses the group: ``variant`` ``"ring"`` (key/value blocks round a
    ring, any number of heads) or ``"ulysses"`` (all-to-all over heads, which must divide by
    cp); ``algorithm``: the gradient all-reduce's, ``all_to_all_algorithm``: Ulysses'
    (None: the communicator's default)."""

    variant: str = "ring"
    algorithm: str | None = None
    all_to_all_algorithm: str | None = None

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"context-parallel variant {self.variant!r} is unknown; choose "
                             f"one of {', '.join(VARIANTS)}")


class ContextParallelEmbeddings(nn.Module):
    """Token embedding plus the position embedding at this rank's true positions. Tokens
    ``(B, T/cp)`` → ``(B, T/cp, H)``, or sequence-first ``(T/cp, B, H)`` (``(T/cp/t, B,
    H)`` with sequence parallelism) for a tensor-parallel shard's embeddings."""

    def __init__(self, full: Any, comm: Communicator) -> None:
        super().__init__()
        self.max_len: int = full.max_len
        self.tokens, self.positions = full.tokens, full.positions
        self.comm = comm
        self.tp_group = getattr(full, "group", None)  # a tensor-parallel shard's
        self.sequence_parallel = bool(getattr(full, "sequence_parallel", False))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local, cp = tokens.shape[-1], self.comm.world_size
        if local * cp > self.max_len:
            raise ValueError(f"sequence of {local * cp} tokens ({local} on each of {cp} "
                             f"context-parallel ranks) is longer than max_len={self.max_len}")
        where = torch.tensor(positions(local * cp, self.comm.rank, cp), device=tokens.device)
        if self.tp_group is None:
            return self.tokens(tokens) + self.positions(where)
        if self.sequence_parallel:  # this tp rank's slice of this cp rank's tokens
            tp, tp_rank = self.tp_group.size, self.tp_group.rank
            if local % tp:
                raise ValueError(f"sequence parallelism splits this rank's {local} tokens "
                                 f"over {tp} ranks; use a sequence length divisible by "
                                 f"{2 * cp * tp} (2*cp*tp)")
            where = where.view(tp, -1)[tp_rank]
        return self.tokens(tokens.t()) + self.positions(where).unsqueeze(1)


class ContextParallelAttention(nn.Module):
    """Causal self-attention whose keys span the group: the original's ``qkv`` and ``out``
    projections (this rank's heads of a tensor-parallel shard), the attention itself by
    ring or Ulysses over the cp group."""

    def __init__(self, full: Any, comm: Communicator, config: ContextParallelConfig,
                 sequence_first: bool) -> None:
        super().__init__()
        self.n_heads: int = full.n_heads
        self.qkv, self.out = full.qkv, full.out
        self.comm, self.config, self.sequence_first = comm, config, sequence_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T/cp, 3W), or (T/cp, B, 3W) sequence-first
        if self.sequence_first:
            qkv = qkv.transpose(0, 1)
        batch, length, width = qkv.shape
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2)
                   for t in qkv.split(width // 3, dim=-1))  # (B, heads, T/cp, W/heads)
        y = self.attend(q, k, v).transpose(1, 2).reshape(batch, length, width // 3)
        return self.out(y.transpose(0, 1) if self.sequence_first else y)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.config.variant == "ring":
            return ring_attention(q, k, v, self.comm)
        return ulysses_attention(q, k, v, self.comm, self.config.all_to_all_algorithm)


class ContextParallelBlock(nn.Module):
    """A pre-norm block around a :class:`ContextParallelAttention` (the original's norms
    and MLP; any layout, they work token by token)."""

    def __init__(self, full: Any, attention: ContextParallelAttention) -> None:
        super().__init__()
        self.norm1, self.attention = full.norm1, attention
        self.norm2, self.mlp = full.norm2, full.mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The TransformerLM's loss: mean cross-entropy over every token."""
    return F.cross_entropy(at_least_fp32(logits.flatten(0, -2)), targets.flatten())


class ContextParallelLM(nn.Sequential):
    """This rank's view of a TransformerLM (or of its tensor-parallel shard) over a
    context-parallel group (build it with :func:`apply_context_parallel`). It takes this
    rank's tokens (:func:`~.layout.split_sequence`) and returns their logits.

    Train with ``model.loss(model(tokens), targets)``, backward, then
    ``model.reduce_context_parallel_grads()`` before the optimizer step."""

    def __init__(self, layers: list[nn.Module], comm: Communicator,
                 config: ContextParallelConfig, base_loss: LossFn) -> None:
        super().__init__(*layers)
        self.comm, self.config = comm, config
        self.base_loss = base_loss

    @property
    def cp_size(self) -> int:
        return self.comm.world_size

    @property
    def cp_rank(self) -> int:
        return self.comm.rank

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's share of the whole sequence's mean loss: the mean over its tokens
        divided by cp. The ranks' shares add up to the loss of the whole sequence."""
        return self.base_loss(logits, targets) / self.cp_size

    def reduce_context_parallel_grads(self) -> None:
        """Sum every parameter's gradient over the group (one flat all-reduce; call after
        backward, before the optimizer)."""
        sum_gradients(list(self.parameters()), self.comm, self.config.algorithm)

    def gather_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's part of ``x`` along ``dim`` (its sequence dimension: 1 for the
        logits ``(B, T/cp, V)``) joined in the natural order: the whole sequence's (for
        evaluation; a collective, without gradient)."""
        cp = self.cp_size
        if cp == 1:
            return x
        part = x.detach().movedim(dim, 0).contiguous()
        gathered = part.new_empty((cp * part.shape[0], *part.shape[1:]))
        self.comm.all_gather(gathered, part, algorithm=self.config.algorithm)
        chunks = gathered.view(2 * cp, part.shape[0] // 2, *part.shape[1:])
        index = torch.tensor(natural_order(cp), device=x.device)
        return chunks.index_select(0, index).flatten(0, 1).movedim(0, dim)


def sum_gradients(params: list[nn.Parameter], comm: Communicator,
                  algorithm: str | None = None) -> None:
    """Sum the gradients of ``params`` over ``comm`` in one flat all-reduce (a missing
    gradient counts as zeros; every rank passes the same parameters). In place where a
    gradient exists: ZeRO's are views of its flat buffer."""
    if not params or comm.world_size == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else
                      torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in params])
    comm.all_reduce(flat, algorithm=algorithm)
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = flat[offset:offset + n].view_as(p).clone()
        else:
            p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n


def apply_context_parallel(model: nn.Module, cp_comm: Communicator, variant: str = "ring",
                           *, algorithm: str | None = None,
                           all_to_all_algorithm: str | None = None) -> ContextParallelLM:
    """``model`` (a TransformerLM, or its tensor-parallel shard) over the context-parallel
    group ``cp_comm``: a :class:`ContextParallelLM` sharing its parameters. Collective over
    ``cp_comm`` (the ring connects each rank to its neighbours here, in an order that cannot
    cycle, as NCCL needs); a one-line ValueError for another model, an unknown variant or
    heads that Ulysses cannot split."""
    config = ContextParallelConfig(variant, algorithm, all_to_all_algorithm)
    layers = lm_layers(model)
    embeddings, blocks = layers[0], layers[1:-2]
    heads, cp = blocks[0].attention.n_heads, cp_comm.world_size
    if variant == "ulysses" and heads % cp:
        raise ValueError(f"Ulysses splits the {heads} attention heads (of this rank) over "
                         f"cp={cp} ranks, which does not divide them; use variant='ring' "
                         f"or a cp that divides the heads")
    sequence_first = getattr(embeddings, "group", None) is not None
    cp_layers: list[nn.Module] = [ContextParallelEmbeddings(embeddings, cp_comm)]
    cp_layers += [ContextParallelBlock(block, ContextParallelAttention(
        block.attention, cp_comm, config, sequence_first)) for block in blocks]
    cp_layers += layers[-2:]
    if variant == "ring" and cp > 1:
        cp_comm.connect(ring_neighbours(cp_comm))
    base_loss: LossFn = getattr(model, "loss", mean_cross_entropy)
    return ContextParallelLM(cp_layers, cp_comm, config, base_loss)


def lm_layers(model: nn.Module) -> list[Any]:
    """The layers of a TransformerLM-shaped ``nn.Sequential``: embeddings with ``tokens``
    and ``positions``, blocks (``norm1``, ``attention`` with ``qkv``, ``out``, ``n_heads``;
    ``norm2``, ``mlp``), a final norm and a head; a one-line ValueError otherwise."""
    layers = list(model) if isinstance(model, nn.Sequential) else []
    ok = len(layers) >= 4 and isinstance(getattr(layers[0], "positions", None), nn.Embedding)
    ok = ok and hasattr(layers[0], "tokens") and isinstance(getattr(layers[0], "max_len", None),
                                                           int)
    for block in layers[1:-2] if ok else ():
        attention = getattr(block, "attention", None)
        ok = ok and all(hasattr(block, n) for n in ("norm1", "norm2", "mlp")) and all(
            hasattr(attention, n) for n in ("qkv", "out")) and isinstance(
            getattr(attention, "n_heads", None), int)
    if not ok:
        raise ValueError(f"context parallelism splits the sequence of disttrain's "
                         f"TransformerLM (its position embedding and attention); got "
                         f"{type(model).__name__}: use --model transformer")
    return layers
