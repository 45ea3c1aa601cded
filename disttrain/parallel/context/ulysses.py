"""Ulysses attention: an all-to-all from a sequence split to a head split, ordinary causal
attention on the whole sequence for a group of heads, and an all-to-all back (Jacobs et al.
2023, "DeepSpeed Ulysses").

Each rank holds all heads of its T/cp tokens. Attention mixes tokens but not heads, so one
all-to-all hands every rank all T tokens of heads/cp heads, and one more after attention
hands each rank its tokens of every head again::

    before: rank r holds tokens of r, all h heads       (B, h, T/cp, D)
             │ all-to-all: head group j of my tokens → rank j
    during: rank r holds every token, heads r·h/cp ..   (B, h/cp, T, D)    causal attention
             │ all-to-all: my heads' tokens of rank j → rank j
    after:  rank r holds tokens of r, all h heads       (B, h, T/cp, D)

An all-to-all with equal blocks is its own transpose (block j goes to rank j, and its
gradient comes back from rank j), so backward runs the same two exchanges in reverse. The
sequence arrives in rank order, each rank's two zig-zag chunks together; putting the chunks
in their natural order (:func:`~.layout.natural_order`, a local copy) lets one causal
attention run as it does on one process.

Bytes per rank per layer: Q, K, V go in one all-to-all (3·B·(T/cp)·H·e, of which each rank
sends (cp − 1)/cp) and the output in another (B·(T/cp)·H·e); backward moves the same:
8·(cp − 1)/cp·B·(T/cp)·H·e, falling as cp grows where the ring's stays flat (:mod:`.theory`).
The heads must divide by cp (by cp·tp with tensor parallelism).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from disttrain.comm import Communicator
from disttrain.parallel.context.layout import natural_order, rank_order

__all__ = ["all_to_all", "ulysses_attention"]


class _AllToAll(torch.autograd.Function):
    """Block j of dim 0 to rank j, block j of the result from rank j; backward the same."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator,
                algorithm: str | None) -> torch.Tensor:
        ctx.comm, ctx.algorithm = comm, algorithm
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all(out, x, algorithm=algorithm)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad, algorithm=ctx.algorithm)
        return out, None, None


def all_to_all(x: torch.Tensor, comm: Communicator, algorithm: str | None = None
               ) -> torch.Tensor:
    """``x``'s block j (along dim 0, ``comm.world_size`` equal blocks) goes to rank j; the
    result's block j came from rank j. Differentiable (backward: the same exchange)."""
    out: torch.Tensor = _AllToAll.apply(x, comm, algorithm)
    return out


def _reorder(x: torch.Tensor, order: list[int], chunks: int) -> torch.Tensor:
    """``x`` (..., T, D) with its T positions cut into ``chunks`` chunks, in ``order``
    (concatenated slices: backward slices the gradient back, and nothing is saved)."""
    pieces = x.chunk(chunks, dim=-2)
    return torch.cat([pieces[i] for i in order], dim=-2)


def _to_heads(x: torch.Tensor, comm: Communicator, algorithm: str | None) -> torch.Tensor:
    """(n, B, h, T/cp, D) this rank's tokens → (n, B, h/cp, T, D), every token in natural
    order, this rank's head group (``n``: tensors sent together)."""
    cp = comm.world_size
    n, batch, heads, length, dim = x.shape
    blocks = x.reshape(n, batch, cp, heads // cp, length, dim).movedim(2, 0)
    gathered = all_to_all(blocks, comm, algorithm)  # (cp [source rank], n, B, h/cp, T/cp, D)
    whole = gathered.movedim(0, 3).reshape(n, batch, heads // cp, cp * length, dim)
    return _reorder(whole, natural_order(cp), 2 * cp)


def _to_sequence(y: torch.Tensor, comm: Communicator, algorithm: str | None) -> torch.Tensor:
    """(B, h/cp, T, D) → (B, h, T/cp, D): the inverse of :func:`_to_heads`. The result is
    laid out (B, T/cp, h, D), so the caller's (B, T/cp, H) view of it is no copy."""
    cp = comm.world_size
    batch, group, length, dim = y.shape
    y = _reorder(y, rank_order(cp), 2 * cp).transpose(1, 2)  # (B, T, h/cp, D)
    blocks = y.reshape(batch, cp, length // cp, group, dim).movedim(1, 0)
    back = all_to_all(blocks, comm, algorithm)  # (cp [head group], B, T/cp, h/cp, D)
    return back.movedim(0, 2).reshape(batch, length // cp, cp * group, dim).transpose(1, 2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                      algorithm: str | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries ``(B, heads, T/cp, D)`` (its zig-zag chunks)
    to every rank's keys and values, by two all-to-alls over ``comm`` (``algorithm``: the
    all-to-all's; None: the communicator's default). ``heads`` must divide by cp."""
    cp, heads = comm.world_size, q.shape[1]
    if heads % cp:
        raise ValueError(f"Ulysses attention splits the {heads} heads of this rank over "
                         f"cp={cp} ranks, which does not divide them; use the ring variant "
                         f"or a cp that divides the heads")
    q, k, v = _to_heads(torch.stack((q, k, v)), comm, algorithm).unbind(0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _to_sequence(y, comm, algorithm)
