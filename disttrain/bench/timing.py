"""Timing statistics: the slowest rank per iteration, percentiles, and bandwidth conventions.

A collective is finished only when its slowest rank is, so each iteration's time is the
maximum over ranks of that rank's time (nccl-tests ``-a 3``). Percentiles then summarise the
iterations: p50 for the typical call, p99 for the tail that scheduling noise creates.

Bandwidth follows nccl-tests (doc/PERFORMANCE.md): ``algbw = bytes / time`` with ``bytes``
the whole buffer (all_gather's output, reduce_scatter's input), and ``busbw = algbw ·
factor``, where the factor makes busbw comparable with the link's bandwidth whatever p is:
all_reduce 2(p−1)/p (every byte is sent twice, once reduced and once gathered);
all_gather, reduce_scatter, all_to_all, gather, scatter (p−1)/p (a rank's own block never
travels); broadcast and reduce 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np


def slowest_rank(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per-iteration maximum over ranks: ``per_rank[r][i]`` is rank r's time of iteration i."""
    if not per_rank:
        raise ValueError("no ranks reported times")
    counts = {len(times) for times in per_rank}
    if len(counts) != 1:
        raise ValueError(f"ranks report different iteration counts: {sorted(counts)}")
    return [max(column) for column in zip(*per_rank)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100) by linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


_BUS_FACTOR = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "gather": lambda p: (p - 1) / p,
    "scatter": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}


def busbw_factor(op: str, p: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``op`` on ``p`` ranks."""
    if op not in _BUS_FACTOR:
        raise ValueError(f"no bus-bandwidth factor for {op!r}; known: {', '.join(_BUS_FACTOR)}")
    if p < 1:
        raise ValueError(f"world size must be ≥ 1, got {p}")
    return float(_BUS_FACTOR[op](p))


def bandwidths(op: str, p: int, nbytes: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10⁹ bytes per second, as nccl-tests prints)."""
    if seconds <= 0:
        raise ValueError(f"a measured time must be positive, got {seconds}")
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * busbw_factor(op, p)


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> tuple[float, float]:
    """(seconds, GB/s) of the fastest of ``repeats`` single-core copies of ``nbytes``
    (``np.copyto`` between two private buffers, pages touched beforehand): what one core
    can stream, the ceiling of any shared-memory collective that copies through one core.
    GB/s counts the bytes copied once (not read + written), like algbw."""
    if nbytes <= 0 or repeats < 1:
        raise ValueError(f"need nbytes > 0 and repeats ≥ 1, got {nbytes}, {repeats}")
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)  # zeros: pages are mapped lazily, copy touches them
    np.copyto(dst, src)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best, nbytes / best / 1e9
