"""What context parallelism should cost, as pure functions (no torch: the simulator imports
them): the bytes each rank sends per training step and the activations attention keeps.

**Communication**, per rank, for one micro-batch of b sequences of s tokens over cp ranks,
L blocks of width h (this rank's: d_model / tp with tensor parallelism), activations of e
bytes; a = b·(s/cp)·h is one of Q, K, V on one rank::

    ring      forward     (cp − 1) KV blocks                     (cp − 1)·2a·e
              backward    (cp − 1) KV blocks, (cp − 1) dKV        (cp − 1)·2a·(e + max(e, 4))
    Ulysses   forward     all-to-all of Q, K, V; of the output   (cp − 1)/cp·4a·e
              backward    the same two, reversed                 (cp − 1)/cp·4a·e

(dKV travels in at least fp32: gradients add up hop by hop.) Per step, once: the
all-reduce of every parameter's gradient over the group (disttrain's ring, exact for any
size: :func:`ring_all_reduce_bytes`). The ring's attention traffic does not shrink as cp
grows (each rank sees every other rank's KV); Ulysses' does, by 1/cp, but needs the heads
to divide by cp. The ring's hides behind compute when a block's attention (∝ (s/cp)²)
outlasts its transfer (∝ s/cp): long sequences.

**Activations** attention keeps for backward, per block: the input of QKV, Q K V (one
tensor), the output (which the out projection keeps too: the same tensor) and the
log-sum-exp per query and head, as the flash kernel of one process does. The ring keeps
them for its own T/cp queries and its own keys (the travelling blocks are dropped after
each step). Ulysses keeps Q, K, V of every token for heads/cp heads (the same size) but its
output twice, head-split for the kernel and sequence-split again for the out projection::

    one process, ring     5·b·(s/cp)·h·e + b·heads·(s/cp)·max(e, 4)     exactly 1/cp of one
    Ulysses               6·b·(s/cp)·h·e + b·heads·(s/cp)·max(e, 4)     process's, ring
"""

from __future__ import annotations

__all__ = ["attention_activation_bytes", "attention_bytes_sent", "attention_forward_bytes",
           "bytes_sent", "ring_all_reduce_bytes"]


def attention_bytes_sent(variant: str, cp: int, batch: int, seq: int, hidden: int,
                         n_layers: int, element_size: int) -> int:
    """Bytes one rank sends for attention in one forward and backward of ``n_layers``
    blocks (``hidden``: this rank's attention width; ``seq``: the whole sequence)."""
    if cp <= 1:
        return 0
    a = batch * (seq // cp) * hidden
    if variant == "ring":
        grad_size = max(element_size, 4)
        per_layer = (cp - 1) * 2 * a * (2 * element_size + grad_size)
    elif variant == "ulysses":
        per_layer = 2 * (cp - 1) * (4 * a // cp) * element_size
    else:
        raise ValueError(f"variant must be 'ring' or 'ulysses', got {variant!r}")
    return n_layers * per_layer


def attention_forward_bytes(variant: str, cp: int, batch: int, seq: int, hidden: int,
                            n_layers: int, element_size: int) -> int:
    """The forward's part of :func:`attention_bytes_sent`: what a block whose activations
    are checkpointed sends again when backward recomputes it (the ring's K and V round the
    ring; Ulysses' all-to-alls of Q, K, V and of the output)."""
    if cp <= 1:
        return 0
    a = batch * (seq // cp) * hidden
    if variant == "ring":
        return n_layers * (cp - 1) * 2 * a * element_size
    if variant == "ulysses":
        return n_layers * (cp - 1) * (4 * a // cp) * element_size
    raise ValueError(f"variant must be 'ring' or 'ulysses', got {variant!r}")


def ring_all_reduce_bytes(numel: int, p: int, rank: int, element_size: int) -> int:
    """Bytes rank ``rank`` sends in disttrain's ring all-reduce of ``numel`` elements over
    ``p`` ranks: the buffer is cut into p segments whose sizes differ by one at most, and
    rank r sends every segment but those of ranks r + 1 and r + 2 twice (reduce-scatter,
    then all-gather): 2·numel − seg(r+1) − seg(r+2), ≈ 2(p − 1)/p·numel."""
    if p <= 1:
        return 0
    base, extra = divmod(numel, p)

    def seg(i: int) -> int:
        return base + (1 if i % p < extra else 0)

    return (2 * numel - seg(rank + 1) - seg(rank + 2)) * element_size


def bytes_sent(variant: str, cp: int, rank: int, *, batch: int, seq: int, hidden: int,
               n_layers: int, params: int, element_size: int, param_element_size: int,
               micro_batches: int = 1) -> int:
    """Bytes rank ``rank`` of the group sends per training step: attention for each of
    ``micro_batches`` micro-batches of ``batch`` sequences, plus the ring all-reduce of the
    ``params`` gradients (elements of ``param_element_size`` bytes). Exact for the ring
    all-reduce and the pairwise (``naive``) all-to-all; other algorithms move other
    amounts (``Communicator.theory_bytes_sent``)."""
    attention = attention_bytes_sent(variant, cp, batch, seq, hidden, n_layers, element_size)
    return micro_batches * attention + ring_all_reduce_bytes(params, cp, rank,
                                                             param_element_size)


def attention_activation_bytes(batch: int, seq: int, hidden: int, heads: int, cp: int,
                               element_size: int, variant: str = "ring") -> int:
    """Bytes one block's attention keeps for backward on one rank (module docstring);
    with cp = 1, one process's."""
    if variant not in ("ring", "ulysses"):
        raise ValueError(f"variant must be 'ring' or 'ulysses', got {variant!r}")
    tokens = batch * (seq // cp)
    copies = 6 if variant == "ulysses" and cp > 1 else 5
    return copies * tokens * hidden * element_size + tokens * heads * max(element_size, 4)
