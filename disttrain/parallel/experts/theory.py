"""What expert parallelism should cost, as pure functions: the capacity of an expert, and the
bytes each rank sends in one training step.

**Capacity.** A sequence of T tokens routed top-k over E experts makes k·T assignments; an
expert takes at most ``C = ⌈factor · k · T / E⌉`` of them per sequence (never more than T:
a token picks k *different* experts), the rest are dropped (Switch Transformer, Fedus et
al. 2021, §2.2; GShard, Lepikhin et al. 2020, §2.2, whose "groups" are our sequences).

**Bytes per rank per step** on the ep communicator, for one MoE layer whose forward sent
``rows_sent`` kept token rows to experts on other ranks and received ``rows_received`` rows
from other ranks for its own experts (hidden size h, e bytes per element)::

    forward   counts all-to-all      (ep − 1) · E/ep · 8        int64 counts, per forward
              dispatch all-to-all    rows_sent · h · e
              combine all-to-all     rows_received · h · e      outputs back to their tokens
    backward  combine⁻¹ all-to-all   rows_sent · h · e          output gradients to experts
              dispatch⁻¹ all-to-all  rows_received · h · e      input gradients back home

    per layer: 2 · (rows_sent + rows_received) · h · e + (ep − 1) · E/ep · 8
    per step:  Σ over layers  +  one all-reduce of the replicated gradients over ep

The rows a rank keeps for itself never travel. The all-to-all splits are uneven and
data-dependent, so the exact figure needs the step's counts (:class:`LayerTraffic`, which
the engine records); with balanced routing and nothing dropped each rank sends
``k·N·(ep − 1)/ep`` of its N tokens' k·N rows and receives as many
(:func:`expected_ep_bytes`, the simulator's figure): 4·k·N·h·e·(ep − 1)/ep per layer.

Pure Python, no torch: the simulator may import it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from disttrain.comm.algorithms.chunking import segment_bounds
from disttrain.comm.theory import theory_bytes_sent

COUNT_BYTES = 8  # the counts exchanged before each dispatch are int64


def capacity(tokens: int, n_experts: int, top_k: int, factor: float | None) -> int:
    """Assignments one expert accepts from one sequence of ``tokens`` tokens: ⌈factor·k·T/E⌉
    (at least 1, at most T); ``factor=None`` accepts all (nothing is dropped)."""
    if factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(factor * top_k * tokens / n_experts)))


@dataclass(frozen=True)
class LayerTraffic:
    """What one MoE layer's dispatch moved on this rank, summed over ``forwards`` forward
    passes: rows (tokens × their experts) sent to other ranks and received from them."""

    rows_sent: int = 0
    rows_received: int = 0
    forwards: int = 0

    def __add__(self, other: LayerTraffic) -> LayerTraffic:
        return LayerTraffic(self.rows_sent + other.rows_sent,
                            self.rows_received + other.rows_received,
                            self.forwards + other.forwards)


def all_reduce_bytes(numel: int, element_size: int, ep: int, rank: int,
                     algorithm: str = "ring") -> float:
    """Bytes rank ``rank`` sends in an all-reduce of ``numel`` elements over ``ep`` ranks:
    exact for disttrain's ring (segments whose sizes differ by one at most), the comm
    module's figure for the other algorithms."""
    if ep <= 1:
        return 0.0
    if algorithm == "ring":
        seg = [end - start for start, end in segment_bounds(numel, ep)]
        return float((2 * numel - seg[(rank + 1) % ep] - seg[(rank + 2) % ep]) * element_size)
    theory = theory_bytes_sent("all_reduce", algorithm, ep, numel * element_size)
    if theory is None:
        raise ValueError(f"algorithm {algorithm!r} sends bytes disttrain cannot see; give the "
                         f"algorithm the all-reduce ran (ring, naive, ...)")
    return theory


def layer_bytes(traffic: LayerTraffic, d_model: int, element_size: int, ep: int,
                n_experts: int, backward: bool = True) -> int:
    """Bytes one MoE layer's all-to-alls send from this rank (see the module docstring)."""
    if ep <= 1:
        return 0
    rows = traffic.rows_sent + traffic.rows_received
    counts = traffic.forwards * (ep - 1) * (n_experts // ep) * COUNT_BYTES
    return (2 if backward else 1) * rows * d_model * element_size + counts


def ep_bytes_per_step(layers: Sequence[LayerTraffic], d_model: int, element_size: int,
                      ep: int, n_experts: int, replicated_numel: int, rank: int,
                      algorithm: str = "ring") -> float:
    """Bytes rank ``rank`` of the ep group sends in one training step: every MoE layer's
    all-to-alls (forward and backward) and one all-reduce of the ``replicated_numel``
    replicated gradient elements (:func:`~.engine.finish_gradients`, by ``algorithm``)."""
    moe = sum(layer_bytes(t, d_model, element_size, ep, n_experts) for t in layers)
    return moe + all_reduce_bytes(replicated_numel, element_size, ep, rank, algorithm)


def expected_ep_bytes(tokens_per_rank: int, top_k: int, d_model: int, n_moe_layers: int,
                      ep: int, n_experts: int, element_size: int, replicated_numel: int,
                      algorithm: str = "ring") -> float:
    """The step's bytes per rank with balanced routing and nothing dropped: of each rank's
    k·N rows a fraction (ep − 1)/ep goes to other ranks, and as many come in."""
    if ep <= 1:
        return 0.0
    rows = top_k * tokens_per_rank * (ep - 1) / ep
    per_layer = 4 * rows * d_model * element_size + (ep - 1) * (n_experts // ep) * COUNT_BYTES
    ring = 2 * (ep - 1) / ep * replicated_numel * element_size
    reduce = ring if algorithm == "ring" else all_reduce_bytes(
        replicated_numel, element_size, ep, 0, algorithm)
    return n_moe_layers * per_layer + reduce
