"""A mixture-of-experts transformer: disttrain's TransformerLM whose feed-forward blocks are
mixtures of E expert MLPs, each token sent to its top-k experts (Shazeer et al. 2017; GShard,
Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021)::

    tokens (B, T) → Embeddings → MoEBlock × n_layers → LayerNorm → Linear → logits

    MoEBlock:  x = x + Attention(LayerNorm(x))
               x = x + MoE(LayerNorm(x))

    MoE(x):    p = softmax(router(x))                     (B, T, E) router probabilities
               top-k experts of each token, gates = their p (k > 1: renormalized to sum 1)
               keep at most C assignments per expert per sequence, drop the rest
               y_t = Σ over kept (t, e) of gate · expert_e(x_t)   (a dropped token: y_t = 0,
                                                                   the residual carries it)

**Capacity and drops.** Each sequence is a routing group (GShard's groups): an expert
accepts at most ``C = ⌈capacity_factor · k · T / E⌉`` of a sequence's k·T assignments
(:func:`disttrain.parallel.experts.capacity`). Within a sequence the assignments queue by
priority, first choices before second choices and each by position, and an expert keeps the
first C of its queue (the cumulative-sum rule of GShard and Switch). The decision depends on
the sequence alone, never on which other sequences share the batch, so one process and any
split over data-parallel or expert-parallel ranks drop exactly the same tokens.

**Load-balancing loss** (Switch Transformer eq. 4, with GShard's per-group mean): per
sequence, ``E · Σ_e f_e · P_e`` where f_e is the fraction of the sequence's k·T assignments
(before capacity) that chose e and P_e the mean router probability of e; 1 when balanced.
Averaged over the sequences and times ``aux_loss_coef``, it is each MoE layer's
``aux_loss`` after a forward; :func:`moe_aux_loss` sums them and :func:`add_aux_loss` adds
that to a loss function, while ``model(x)`` still returns the logits alone.

The experts are :class:`disttrain.parallel.experts.Experts`: on ep ranks
:func:`~disttrain.parallel.experts.apply_expert_parallel` replaces them with this rank's
share, and rows travel by all-to-all; routing stays here, on each rank for its own tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.experts import Experts, capacity
from disttrain.parallel.mixed_precision import at_least_fp32
from disttrain.train.transformer import CausalSelfAttention, Embeddings


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward block's options, validated on creation."""

    n_experts: int = 4
    top_k: int = 2  # 1: Switch Transformer; 2: GShard, Mixtral
    capacity_factor: float | None = 1.25  # None: no capacity limit, nothing dropped
    aux_loss_coef: float = 0.01  # the load-balancing loss's weight (Switch: 0.01)
    d_ff: int | None = None  # each expert's hidden width; None: 4 × d_model

    def __post_init__(self) -> None:
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) \
                or self.n_experts < 1:
            raise ValueError(f"n_experts must be an int ≥ 1, got {self.n_experts!r}")
        if isinstance(self.top_k, bool) or self.top_k not in (1, 2) \
                or self.top_k > self.n_experts:
            raise ValueError(f"top_k must be 1 or 2 and at most n_experts={self.n_experts}, "
                             f"got {self.top_k!r}")
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(
                factor, (int, float)) or not 0 < factor < math.inf):
            raise ValueError(f"capacity_factor must be a positive number (or None: no "
                             f"limit), got {self.capacity_factor!r}")
        if not isinstance(self.aux_loss_coef, (int, float)) or self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be a number ≥ 0, got {self.aux_loss_coef!r}")
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or self.d_ff < 1):
            raise ValueError(f"d_ff must be an int ≥ 1 (or None: 4 × d_model), got "
                             f"{self.d_ff!r}")


@dataclass(frozen=True)
class Routing:
    """Where one batch's tokens go: the kept assignments sorted by (expert, token)."""

    token: torch.Tensor  # (M,) flat index (b·T + t) of each kept assignment's token
    gate: torch.Tensor  # (M,) its weight, differentiable
    counts: list[int]  # kept assignments of each expert (sum M)
    dropped: int  # assignments beyond their expert's capacity
    balance: torch.Tensor  # the load-balancing loss, unweighted (1 when balanced)


@dataclass(frozen=True)
class RoutingStats:
    """Dropped-token accounting of one MoE layer's last forward."""

    tokens: int
    assignments: int  # tokens × k
    dropped: int
    kept_per_expert: tuple[int, ...]

    @property
    def dropped_fraction(self) -> float:
        return self.dropped / self.assignments if self.assignments else 0.0


def route(probs: torch.Tensor, top_k: int, slots: int) -> Routing:
    """Top-k routing of ``probs`` (B, T, E) with ``slots`` assignments per expert per
    sequence (see the module docstring for the priority rule)."""
    batch, length, n_experts = probs.shape
    top_p, top_e = probs.topk(top_k, dim=-1)  # (B, T, k)
    gate = top_p / top_p.sum(-1, keepdim=True) if top_k > 1 else top_p
    chosen = F.one_hot(top_e, n_experts)  # (B, T, k, E)
    # queue order within a sequence: slot-major (first choices first), then position
    queue = chosen.transpose(1, 2).reshape(batch, top_k * length, n_experts)
    place = (queue.cumsum(1) * queue).sum(-1)  # 1-based place in its expert's queue
    keep = (place <= slots).view(batch, top_k, length).transpose(1, 2)  # (B, T, k)
    token = torch.arange(batch * length, device=probs.device).view(batch, length, 1)
    kept_token = token.expand(-1, -1, top_k)[keep]
    kept_expert = top_e[keep]
    order = (kept_expert * (batch * length) + kept_token).argsort()  # unique keys
    fraction = chosen.sum(2).to(probs.dtype).mean(1) / top_k  # (B, E): f_e per sequence
    balance = n_experts * (fraction * probs.mean(1)).sum(-1).mean()
    return Routing(kept_token[order], gate[keep][order],
                   torch.bincount(kept_expert, minlength=n_experts).tolist(),
                   int((~keep).sum()), balance)


class MoEFeedForward(nn.Module):
    """Router and experts: (B, T, d_model) → (B, T, d_model). After each forward,
    ``aux_loss`` holds its weighted load-balancing loss and ``stats`` its drops."""

    def __init__(self, d_model: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(d_model, config.n_experts, bias=False)
        self.experts = Experts.build(config.n_experts, d_model, config.d_ff or 4 * d_model)
        self.aux_loss: torch.Tensor | None = None
        self.stats: RoutingStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d_model = x.shape
        flat = x.reshape(batch * length, d_model)
        probs = torch.softmax(at_least_fp32(self.router(flat)), dim=-1)
        c = self.config
        routing = route(probs.view(batch, length, -1), c.top_k,
                        capacity(length, c.n_experts, c.top_k, c.capacity_factor))
        out = self.experts(flat[routing.token], routing.counts)
        weighted = out * routing.gate.to(out.dtype).unsqueeze(-1)
        y = flat.new_zeros(flat.shape).index_add(0, routing.token, weighted)
        self.aux_loss = c.aux_loss_coef * routing.balance
        self.stats = RoutingStats(batch * length, batch * length * c.top_k, routing.dropped,
                                  tuple(routing.counts))
        return y.view(batch, length, d_model)

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["aux_loss"] = None  # a copy of the module (deepcopy) keeps no autograd graph
        return state


class MoEBlock(nn.Module):
    """Pre-norm transformer block whose feed-forward block is a mixture of experts."""

    def __init__(self, d_model: int, n_heads: int, config: MoEConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = MoEFeedForward(d_model, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerMoE(nn.Sequential):
    """TransformerLM's layout with MoE blocks: embeddings, ``n_layers`` MoE blocks, a final
    LayerNorm and the vocabulary projection; ``model(x)`` returns the logits and
    ``model.aux_loss`` the last forward's load-balancing loss (weighted, summed over
    layers)."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 2, moe: MoEConfig | None = None) -> None:
        if vocab_size < 2 or max_len < 1 or n_layers < 1:
            raise ValueError(f"TransformerMoE needs vocab_size ≥ 2, max_len ≥ 1, n_layers ≥ 1; "
                             f"got {vocab_size}, {max_len}, {n_layers}")
        moe = moe or MoEConfig()
        super().__init__(
            Embeddings(vocab_size, max_len, d_model),
            *(MoEBlock(d_model, n_heads, moe) for _ in range(n_layers)),
            nn.LayerNorm(d_model),
            nn.Linear(d_model, vocab_size),
        )

    @property
    def aux_loss(self) -> torch.Tensor:
        loss = moe_aux_loss(self)
        if loss is None:
            raise RuntimeError("TransformerMoE.aux_loss is the last forward's: run the model "
                               "before reading it")
        return loss


def moe_layers(module: nn.Module) -> list[MoEFeedForward]:
    """The MoE feed-forward blocks inside ``module`` (a model, a wrapper, a pipeline stage)."""
    return [m for m in module.modules() if isinstance(m, MoEFeedForward)]


def moe_aux_loss(module: nn.Module) -> torch.Tensor | None:
    """The weighted load-balancing losses of ``module``'s MoE layers' last forwards, summed
    (None: no MoE layer has run)."""
    losses = [m.aux_loss for m in moe_layers(module) if m.aux_loss is not None]
    if not losses:
        return None
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


def routing_stats(module: nn.Module) -> list[RoutingStats]:
    """Each MoE layer's dropped-token accounting of its last forward."""
    return [m.stats for m in moe_layers(module) if m.stats is not None]


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def add_aux_loss(loss_fn: LossFn, module: nn.Module) -> LossFn:
    """``loss_fn`` plus the load-balancing loss of ``module``'s last forward (read after
    the model ran: ``loss(model(x), y)``)."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        aux = moe_aux_loss(module)
        main = loss_fn(output, target)
        return main if aux is None else main + aux.to(main.dtype)

    return loss
