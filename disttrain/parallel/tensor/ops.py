"""The communication of tensor parallelism, as autograd functions: Megatron's conjugate pair
f / g, sequence parallelism's all-gather / reduce-scatter pair, and the vocabulary-parallel
cross-entropy.

f and g are each other's transpose (Shoeybi et al. 2019, "Megatron-LM", §3)::

    f: forward identity,   backward all-reduce     (enters a column-parallel linear:
         x ──────────▶ x        dx = Σ_r dx_r          every rank's input is the same x,
                                                       so its gradient is the sum)
    g: forward all-reduce, backward identity       (leaves a row-parallel linear:
         y_r ──Σ──▶ y           dy ──────────▶ dy       each rank holds a partial sum)

Sequence parallelism (Korthikanti et al. 2022, §4.2.2) shards the activations between the
blocks along the sequence; the same two places then communicate with the pair below, which
moves exactly what one all-reduce moves (an all-reduce *is* a reduce-scatter followed by an
all-gather)::

    ḡ = all_gather_sequence:     forward all-gather (T/t → T),  backward reduce-scatter
    ḡ* = reduce_scatter_sequence: forward reduce-scatter (T → T/t), backward all-gather

Activations are sequence-first, ``(T, B, H)``, so rank r's slice of the sequence is one
contiguous block: the Communicator's ``all_gather`` and ``reduce_scatter`` take flat blocks
in rank order, and no copy is needed around them.

Every call goes through the :class:`~disttrain.comm.Communicator` (its bytes are counted
by ``comm.stats``), with the algorithm of :class:`TPGroup` (None: the communicator's
default). Gradients are reduced in place: the gradient of a linear layer's input is a
fresh tensor nobody else holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from disttrain.comm import Communicator
from disttrain.parallel.mixed_precision import at_least_fp32


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group: its communicator and the algorithm its collectives use."""

    comm: Communicator
    algorithm: str | None = None

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.world_size

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.comm.all_reduce(t, op, algorithm=self.algorithm)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Rank blocks of ``t`` concatenated along dim 0."""
        out = t.new_empty((t.shape[0] * self.size, *t.shape[1:]))
        self.comm.all_gather(out, t.contiguous(), algorithm=self.algorithm)
        return out

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's block (along dim 0) of the sum over ranks of ``t``."""
        if t.shape[0] % self.size:
            raise ValueError(f"cannot reduce-scatter {t.shape[0]} rows over {self.size} "
                             f"tensor-parallel ranks; the length must divide by the TP size")
        out = t.new_empty((t.shape[0] // self.size, *t.shape[1:]))
        self.comm.reduce_scatter(out, t.contiguous(), algorithm=self.algorithm)
        return out


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad if grad.is_contiguous() else grad.contiguous()


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_reduce(_contiguous(grad)), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return group.all_reduce(_contiguous(x))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """ḡ: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return group.all_gather(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.reduce_scatter(grad), None


class _ScatterSequence(torch.autograd.Function):
    """ḡ*: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return group.reduce_scatter(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_gather(grad), None


def copy_to_tp(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """f (see the module docstring)."""
    out: torch.Tensor = _CopyToTP.apply(x, group)
    return out


def reduce_from_tp(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """g (see the module docstring)."""
    out: torch.Tensor = _ReduceFromTP.apply(x, group)
    return out


def all_gather_sequence(x: torch.Tensor, group: TPGroup, dim: int = 0) -> torch.Tensor:
    """ḡ: ``(T/t, B, H)`` → ``(T, B, H)``; backward reduce-scatters. ``dim``: the sequence
    dimension (1 for batch-first activations: moved to the front around the collective)."""
    if dim:
        return all_gather_sequence(x.movedim(dim, 0), group).movedim(0, dim)
    out: torch.Tensor = _GatherSequence.apply(x, group)
    return out


def reduce_scatter_sequence(x: torch.Tensor, group: TPGroup, dim: int = 0) -> torch.Tensor:
    """ḡ*: partial sums ``(T, B, H)`` → this rank's reduced ``(T/t, B, H)``; backward
    all-gathers. ``dim``: the sequence dimension."""
    if dim:
        return reduce_scatter_sequence(x.movedim(dim, 0), group).movedim(0, dim)
    out: torch.Tensor = _ScatterSequence.apply(x, group)
    return out


# ------------------------------------------ entering and leaving the sequence-parallel region
class _SplitSequence(torch.autograd.Function):
    """Whole and replicated → this rank's block: forward keeps the block (no
    communication), backward all-gathers the blocks' gradients (replicated again)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        check_sequence(x.shape[0], group.size)
        per = x.shape[0] // group.size
        return x[group.rank * per:(group.rank + 1) * per].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.all_gather(grad), None


class _JoinSequence(torch.autograd.Function):
    """This rank's block → whole and replicated: forward all-gathers, backward keeps this
    rank's block of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return group.all_gather(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        per = grad.shape[0] // ctx.group.size
        return grad[ctx.group.rank * per:(ctx.group.rank + 1) * per].contiguous(), None


def split_sequence(x: torch.Tensor, group: TPGroup, dim: int = 0) -> torch.Tensor:
    """Enter the sequence-parallel region from a whole, replicated tensor (the same on
    every rank): this rank's block of the sequence; backward all-gathers, so the gradient
    leaving is whole and replicated too. A model whose own code needs the whole sequence
    first (positions, masks: Hugging Face's) enters the region here, at its first block."""
    if dim:
        return split_sequence(x.movedim(dim, 0), group).movedim(0, dim)
    out: torch.Tensor = _SplitSequence.apply(x, group)
    return out


def join_sequence(x: torch.Tensor, group: TPGroup, dim: int = 0) -> torch.Tensor:
    """Leave the sequence-parallel region to whole, replicated activations (for code that
    reshapes with the whole length, such as GPT-2's after its last norm): forward
    all-gathers, backward keeps this rank's block, so whatever consumes the result must
    hand back a replicated gradient (a column-parallel layer's f does)."""
    if dim:
        return join_sequence(x.movedim(dim, 0), group).movedim(0, dim)
    out: torch.Tensor = _JoinSequence.apply(x, group)
    return out


def check_sequence(length: int, tp: int) -> None:
    """One-line ValueError when a sequence of ``length`` does not split over ``tp``."""
    if length % tp:
        raise ValueError(f"sequence parallelism splits each sequence over {tp} ranks, but it "
                         f"has {length} tokens; use a sequence length divisible by {tp} "
                         f"(--seq-len)")


# ------------------------------------------------------------- sequence-parallel gradients
def reduce_sequence_parallel_grads(params: list[torch.nn.Parameter], group: TPGroup) -> None:
    """Sum the gradients of ``params`` (replicated parameters that saw this rank's part of
    the sequence only: their gradients are partial sums) over ``group`` in one flat
    all-reduce (a missing gradient counts as zeros; every rank of the group passes the same
    parameters)."""
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else
                      torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in params])
    group.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = flat[offset:offset + n].view_as(p).clone()
        else:  # in place: ZeRO's gradients are views of its flat buffer
            p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n


# ---------------------------------------------------------------------------- the loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary (Megatron-LM's): three sums
    over the ranks of one number per token instead of gathering the ``V``-wide logits.

    ::

        m      = max_r max_v z[v]               all-reduce (max)  N floats
        S, z_y = Σ_r Σ_v exp(z[v] − m),         all-reduce (sum)  2N floats, together
                 Σ_r z[y] − m (0 off-shard)
        loss   = log S − z_y

    Backward needs no communication: d loss / dz = softmax(z) − onehot(y), each rank on its
    own columns.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: TPGroup,
                vocab_start: int) -> torch.Tensor:
        vocab_local = logits.shape[-1]
        logits = at_least_fp32(logits)
        peak = logits.amax(dim=-1).contiguous()
        group.all_reduce(peak, "max")
        shifted = logits - peak.unsqueeze(-1)  # a new tensor: logits stay untouched
        local = target - vocab_start
        outside = (local < 0) | (local >= vocab_local)
        local.masked_fill_(outside, 0)
        sums = torch.empty((2, *peak.shape), dtype=shifted.dtype, device=shifted.device)
        torch.gather(shifted, -1, local.unsqueeze(-1), out=sums[1].unsqueeze(-1))
        sums[1].masked_fill_(outside, 0.0)
        exp = shifted.exp_()
        torch.sum(exp, dim=-1, out=sums[0])
        group.all_reduce(sums)
        total, picked = sums[0], sums[1]
        exp.div_(total.unsqueeze(-1))  # now the softmax, kept for backward
        ctx.save_for_backward(exp, local, outside)
        return torch.log(total) - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        # in place: the softmax is used once (a graph is back-propagated once)
        hit = (~outside).to(softmax.dtype).unsqueeze(-1)
        softmax.scatter_add_(-1, local.unsqueeze(-1), -hit)
        softmax.mul_(grad.unsqueeze(-1))
        return softmax, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: TPGroup,
                                 vocab_start: int) -> torch.Tensor:
    """Per-token cross-entropy (shape of ``target``) from this rank's logits ``(..., V/t)``,
    which hold vocabulary entries ``vocab_start .. vocab_start + V/t − 1``; the same value
    on every rank of ``group``."""
    out: torch.Tensor = _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)
    return out


def vocab_parallel_loss(logits: torch.Tensor, target: torch.Tensor, group: TPGroup,
                        vocab_start: int, ignore_index: int = -100,
                        num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the tokens whose target is not ``ignore_index`` (as
    ``F.cross_entropy`` takes it), from this rank's logits ``(..., V/t)``; with
    ``num_items``, the sum divided by it (Hugging Face's ``num_items_in_batch``)."""
    valid = target != ignore_index
    per_token = vocab_parallel_cross_entropy(logits, target, group, vocab_start)
    total = per_token.masked_fill(~valid, 0.0).sum()
    if num_items is None:
        return total / valid.sum()
    return total / num_items


def gather_vocab(logits: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """The full logits ``(..., V)`` from every rank's ``(..., V/t)`` (evaluation only:
    training never gathers them). No gradient."""
    shards = group.all_gather(logits.detach().movedim(-1, 0).contiguous())
    return shards.movedim(0, -1)
