"""The zig-zag split of a sequence over the ranks of a context-parallel group, as pure data.

Causal attention is a triangle: position t attends to positions ≤ t. Cut the sequence into
``cp`` contiguous pieces and the last rank's queries see every key while the first rank's
see only its own: the first ranks idle while the last works (the ring runs at the pace of
its busiest rank). The zig-zag split (Megatron-Core's context parallelism, its
load-balanced causal split) cuts the sequence into ``2·cp`` chunks and gives rank r chunks r and
2·cp − 1 − r, a cheap one from the front and a dear one from the back::

    T = 12, cp = 3: six chunks of c = 2 tokens

    chunk     0     1     2     3     4     5
    tokens   0 1   2 3   4 5   6 7   8 9  10 11
    rank      0     1     2     2     1     0          rank r: chunks r and 5 − r

Every rank then holds the same amount of the triangle: ``work_blocks`` counts it (in
c × c blocks of query × key) for both splits, and the tests check that the zig-zag one is
flat. A rank's tokens are its two chunks, front then back, so its positions increase: within
a rank, causal masking is the ordinary lower triangle.

The same split serves both variants: ring attention needs it for balance; Ulysses gathers
the whole sequence for a group of heads, in rank order, and puts the chunks back in their
natural order (:func:`natural_order`) before one causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RingStep", "check_sequence", "chunk_ids", "natural_order", "positions",
           "rank_order", "ring_schedule", "split_sequence", "work_blocks"]


def check_sequence(length: int, cp: int) -> None:
    """One-line ValueError when a sequence of ``length`` tokens does not split into the
    ``2·cp`` equal chunks of the zig-zag split."""
    if cp > 1 and length % (2 * cp):
        raise ValueError(f"context parallelism over {cp} ranks cuts each sequence into "
                         f"2*cp = {2 * cp} equal chunks (the zig-zag split), but it has "
                         f"{length} tokens; use a sequence length divisible by {2 * cp} "
                         f"(--seq-len)")


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that rank ``cp_rank`` holds: ``(r, 2·cp − 1 − r)``."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank must be in 0..{cp - 1}, got {cp_rank}")
    return cp_rank, 2 * cp - 1 - cp_rank


def positions(length: int, cp_rank: int, cp: int) -> list[int]:
    """The true positions (0 .. length − 1) of rank ``cp_rank``'s tokens, in its order:
    its front chunk, then its back chunk. ``length`` is the whole sequence's."""
    if cp == 1:
        return list(range(length))
    check_sequence(length, cp)
    c = length // (2 * cp)
    front, back = chunk_ids(cp_rank, cp)
    return [*range(front * c, (front + 1) * c), *range(back * c, (back + 1) * c)]


def rank_order(cp: int) -> list[int]:
    """The chunks of every rank laid end to end, rank 0's two first (what an all-gather of
    the ranks' tokens holds): ``[0, 2cp−1, 1, 2cp−2, ...]``. Indexing the natural order
    with it gives the gathered order back."""
    return [chunk for r in range(cp) for chunk in chunk_ids(r, cp)]


def natural_order(cp: int) -> list[int]:
    """Where each chunk of the natural order sits in :func:`rank_order`:
    ``gathered[natural_order(cp)]`` is chunks 0, 1, ... 2·cp − 1 (its inverse)."""
    gathered = rank_order(cp)
    return [gathered.index(chunk) for chunk in range(2 * cp)]


def split_sequence(batch: torch.Tensor, cp_rank: int, cp: int, dim: int = -1
                   ) -> torch.Tensor:
    """Rank ``cp_rank``'s tokens of ``batch`` along ``dim`` (default: the last, the
    sequence of ``(B, T)`` token ids or targets): its two zig-zag chunks, front then back.
    Apply it alike to the inputs and the targets; a length that does not divide by
    ``2·cp`` is a one-line ValueError."""
    if cp == 1:
        return batch
    index = torch.tensor(positions(batch.shape[dim], cp_rank, cp), device=batch.device)
    return batch.index_select(dim, index)


def work_blocks(cp: int, zigzag: bool = True) -> list[int]:
    """Causal attention work per rank, in c × c blocks of (query chunk, key chunk) that are
    not masked out entirely (a diagonal block counts as one), with the sequence cut into
    2·cp chunks of c tokens: zig-zag, or two adjacent chunks per rank (``zigzag=False``,
    the contiguous split). Zig-zag gives every rank 2·cp + 1 blocks."""
    owners = [chunk_ids(r, cp) if zigzag else (2 * r, 2 * r + 1) for r in range(cp)]
    return [sum(query + 1 for query in chunks) for chunks in owners]


@dataclass(frozen=True)
class RingStep:
    """What rank r computes at one step of ring attention: its queries ``queries`` (a slice
    of its two chunks, 0:2 both, 1:2 the back one) against keys ``keys`` of the block of
    rank ``src`` (0:2, or 0:1 its front chunk), causally masked on the diagonal step."""

    src: int
    queries: slice
    keys: slice
    causal: bool


def ring_schedule(cp_rank: int, cp: int) -> list[RingStep]:
    """Ring attention's steps on rank ``cp_rank``: at step s it holds the keys and values of
    rank src = (r − s) mod cp. With the zig-zag split (chunks r and 2cp−1−r)::

        s = 0        its own block: both chunks against both, causal (lower triangle)
        src < r      both query chunks against src's front chunk only (src's back chunk
                     2cp−1−src comes after both of r's)
        src > r      r's back chunk only against both of src's chunks (src's front chunk
                     is after r's front one; both are before r's back one)

    so every step but the first costs half a block, on every rank: the ring stays
    balanced. Pure data: the tests check it covers exactly the causal pairs."""
    both, front, back = slice(0, 2), slice(0, 1), slice(1, 2)
    steps = []
    for s in range(cp):
        src = (cp_rank - s) % cp
        if s == 0:
            steps.append(RingStep(src, both, both, True))
        elif src < cp_rank:
            steps.append(RingStep(src, both, front, False))
        else:
            steps.append(RingStep(src, back, both, False))
    return steps
