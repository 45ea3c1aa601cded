"""What tensor parallelism should cost, as pure functions: every collective of a step, the
bytes each rank sends, and the activation bytes autograd keeps per transformer block.

**Communication.** With b sequences of s tokens, hidden size h, vocabulary V, L blocks and
t ranks (one micro-batch; element size e)::

                         forward                      backward
    embedding            all-reduce  b·s·h            -
    each block           2 all-reduces b·s·h (g)      2 all-reduces b·s·h (f)
    head                 -                            all-reduce b·s·h (f)
    cross-entropy        all-reduce b·s (max), all-reduce 2·b·s (sums), fp32

Sequence parallelism replaces each all-reduce of b·s·h by a reduce-scatter (forward of g,
backward of f) and an all-gather on the other side (forward of f, backward of g): the same
(t − 1)/t·b·s·h·e per rank for each half, 2(t − 1)/t·b·s·h·e per pair, what one ring
all-reduce sends. It adds one all-reduce per step of the sequence-parallel parameters'
gradients (LayerNorms, row-parallel biases, positions: 6h per block + 2h + max_len·h).

A ring all-reduce of n elements over p ranks sends 2(p − 1)/p·n per rank when n divides
by p; disttrain's ring cuts n into p segments whose sizes differ by one at most, so rank r
sends exactly ``2n − seg((r+1) % p) − seg((r+2) % p)`` (:func:`ring_bytes_sent`): the tests
compare the transport's counters with these figures exactly.

**Activations** (Korthikanti et al. 2022, §4; their per-layer count is for fp16 with
dropout masks and the s² attention matrix: sbh(10 + 24/t + 5as/(ht)) with TP,
sbh/t·(34 + 5as/h) with TP + SP). For this model (no dropout, the CPU flash-attention kernel
that keeps the log-sum-exp a·b·s instead of the attention matrix, elements of e bytes),
counting what autograd saves in one block::

    kept on every rank                 TP (t ranks)             TP + SP
    LayerNorm inputs (2)               2sbh                     2sbh/t
    LayerNorm mean, rstd (2 × 2)       4sb                      4sb/t
    inputs of QKV and fc1 (gathered)   2sbh                     2sbh
    Q, K, V; attention out; lse        4sbh/t + asb/t           4sbh/t + asb/t
    fc1 out, GELU out                  8sbh/t                   8sbh/t

TP alone: sbh(4 + 12/t) + 4sb + asb/t; SP saves the LayerNorm activations, 2sbh(1 − 1/t)
+ 4sb(1 − 1/t). Megatron-LM also keeps only the local slice of the inputs of QKV and fc1 and
all-gathers them again in backward (one more all-gather per column-parallel layer), which
brings the 2sbh down to 2sbh/t; disttrain keeps them, so that SP moves exactly TP's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from disttrain.comm.algorithms.chunking import segment_bounds
from disttrain.comm.theory import theory_bytes_sent

OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class LMShape:
    """The sizes of a TransformerLM that its communication depends on."""

    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    max_len: int

    def sequence_parallel_params(self) -> int:
        """Elements of the parameters whose gradients SP all-reduces over the group."""
        return 6 * self.d_model * self.n_layers + 2 * self.d_model + self.max_len * self.d_model


@dataclass(frozen=True)
class Collective:
    """One collective of a step: ``numel`` elements of ``element_size`` bytes (the whole
    buffer: the input of a reduce-scatter, the output of an all-gather)."""

    op: str
    numel: int
    element_size: int
    where: str  # e.g. "block 1 attention forward (g)"


def tp_collectives(shape: LMShape, batch: int, seq: int, tp: int, sequence_parallel: bool,
                   element_size: int = 4, layers: range | None = None) -> list[Collective]:
    """Every TP collective of one forward and backward of ``batch`` sequences of ``seq``
    tokens, in the order they run (the SP gradient all-reduce is per step: see
    :func:`tp_step_collectives`). ``layers``: the model's layer indices this rank holds (a
    pipeline stage: 0 is the embedding, 1..L the blocks, L + 1 the final norm, L + 2 the
    head and its loss); None: all."""
    if tp <= 1:
        return []
    act = batch * seq * shape.d_model
    tokens = batch * seq

    def pair(where: str, forward_reduces: bool) -> list[Collective]:
        """g (forward reduce) or f (forward copy) at ``where``: its forward collective."""
        if not sequence_parallel:
            return [Collective("all_reduce", act, element_size, where)] if forward_reduces \
                else []
        op = "reduce_scatter" if forward_reduces else "all_gather"
        return [Collective(op, act, element_size, where)]

    def backward(where: str, forward_reduces: bool) -> list[Collective]:
        if not sequence_parallel:
            return [] if forward_reduces else [Collective("all_reduce", act, element_size,
                                                          where)]
        op = "all_gather" if forward_reduces else "reduce_scatter"
        return [Collective(op, act, element_size, where)]

    held = range(shape.n_layers + 3) if layers is None else layers
    # (name, forward reduces?) in forward order: g after a row-parallel layer, f before a
    # column-parallel one
    points = [("embedding (g)", True)] if 0 in held else []
    for layer in range(1, shape.n_layers + 1):
        if layer in held:
            points += [(f"block {layer} before QKV (f)", False),
                       (f"block {layer} after attention (g)", True),
                       (f"block {layer} before fc1 (f)", False),
                       (f"block {layer} after MLP (g)", True)]
    head = shape.n_layers + 2 in held
    if head:
        points.append(("head (f)", False))
    out = [c for name, reduces in points for c in pair(f"{name} forward", reduces)]
    if head:
        out += [Collective("all_reduce", tokens, 4, "cross-entropy max"),
                Collective("all_reduce", 2 * tokens, 4, "cross-entropy sums")]
    out += [c for name, reduces in reversed(points)
            for c in backward(f"{name} backward", reduces)]
    return out


def tp_step_collectives(shape: LMShape, batch: int, seq: int, tp: int,
                        sequence_parallel: bool, microbatches: int = 1,
                        element_size: int = 4, grad_element_size: int = 4,
                        recomputed: Sequence[int] = ()) -> list[Collective]:
    """One optimizer step of ``microbatches`` micro-batches of ``batch`` sequences each.
    ``recomputed``: the blocks (1..L) whose forward runs again in backward (activation
    checkpointing): each one's forward collectives again but its last, the reduction of
    the block's output, which torch's checkpoint does not recompute (it stops once the
    tensors backward needs are back, and none needs the output)."""
    once = tp_collectives(shape, batch, seq, tp, sequence_parallel, element_size)
    out = (once + recomputed_collectives(once, recomputed)) * microbatches
    if sequence_parallel and tp > 1:
        out.append(Collective("all_reduce", shape.sequence_parallel_params(), grad_element_size,
                              "sequence-parallel gradients"))
    return out


def recomputed_collectives(once: list[Collective], blocks: Sequence[int]) -> list[Collective]:
    """What ``blocks`` (1..L) send again when backward recomputes their forward (activation
    checkpointing): each one's forward collectives in ``once`` but its last, the
    reduction of its output, which torch's checkpoint leaves out (it stops recomputing once
    the tensors backward needs are back)."""
    again: list[Collective] = []
    for b in blocks:
        forward = [c for c in once if c.where.startswith(f"block {b} ")
                   and c.where.endswith("forward")]
        again += forward[:-1]
    return again


def ring_bytes_sent(op: str, p: int, numel: int, element_size: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in disttrain's ring ``op`` of ``numel`` elements (the whole
    buffer) over ``p`` ranks; exact, also when ``numel`` does not divide by ``p``."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if p <= 1:
        return 0
    if op == "all_reduce":
        seg = [end - start for start, end in segment_bounds(numel, p)]
        return (2 * numel - seg[(rank + 1) % p] - seg[(rank + 2) % p]) * element_size
    if numel % p:
        raise ValueError(f"{op} of {numel} elements does not split into {p} equal blocks")
    return (p - 1) * (numel // p) * element_size


def bytes_sent(collectives: list[Collective], p: int, rank: int,
               price: Callable[[str, int], float | None] | None = None) -> float:
    """What ``rank`` sends in ``collectives`` over ``p`` ranks: over a ring (exact), or, where
    ``price(op, nbytes)`` gives a figure that differs from the ring's, that figure (the
    communicator's own algorithm: ``shm`` writes a reduce-scatter's every block once, so it
    counts ``nbytes`` where the ring sends (p − 1)/p of it). ``price`` returning None (the
    native algorithm, whose bytes are invisible) keeps the ring's figure."""
    total = 0.0
    for c in collectives:
        ring = ring_bytes_sent(c.op, p, c.numel, c.element_size, rank)
        priced = None if price is None else price(c.op, c.numel * c.element_size)
        even_ring = theory_bytes_sent(c.op, "ring", p, c.numel * c.element_size)
        differs = priced is not None and even_ring is not None and abs(priced - even_ring) >= 1
        total += priced if differs and priced is not None else ring
    return total


def block_activation_elements(seq: int, batch: int, d_model: int, n_heads: int, tp: int,
                              sequence_parallel: bool) -> int:
    """Elements autograd keeps for backward in one block on one rank (module docstring)."""
    s, b, h, a, t = seq, batch, d_model, n_heads, tp
    sbh = s * b * h
    local = 12 * sbh // t + a * s * b // t
    if sequence_parallel:
        return 2 * sbh + 2 * sbh // t + 4 * s * b // t + local
    return 4 * sbh + 4 * s * b + local


def block_activation_bytes(seq: int, batch: int, d_model: int, n_heads: int, tp: int,
                           sequence_parallel: bool, element_size: int = 4) -> int:
    return element_size * block_activation_elements(seq, batch, d_model, n_heads, tp,
                                                    sequence_parallel)
