"""Measured cost tables: an algorithm's own time at a few sizes, interpolated in between.

The closed forms of :mod:`~disttrain.comm.cost_model` build every algorithm's time from three
link constants (α, β, γ). On ranks that share a host's cores that is not enough: each
algorithm wakes threads in its own pattern (one-way tree steps, exchange steps, p−1 direct
sends), so algorithms with the same formula shape run at different effective α and β.
``disttrain bench comm --calibrate`` therefore also times each algorithm at a few sizes, and
the model reads those times back by *piecewise α-β fits*: between two measured sizes n₀ < n₁
the time is t₀ + (n − n₀)·(t₁ − t₀)/(n₁ − n₀), i.e. a local α + n·β through both points
(the tuned decision tables of MPICH and Open MPI, measured instead of hand-written). Beyond
the measured range the nearest segment's line is extended with a slope of at least zero.

A table is ``((nbytes, seconds), ...)`` with strictly increasing sizes; tables are keyed
``"op/algorithm"`` and belong to one world size (they are never carried to another).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any

Table = tuple[tuple[int, float], ...]


def table_key(op: str, algorithm: str) -> str:
    return f"{op}/{algorithm}"


def validate_tables(tables: Iterable[tuple[str, Table]]) -> None:
    """ValueError naming the bad entry unless every table is ≥ 2 points with strictly
    increasing non-negative sizes and finite non-negative times."""
    for key, points in tables:
        if not isinstance(key, str) or key.count("/") != 1:
            raise ValueError(f"LinkCosts.measured key must be 'op/algorithm', got {key!r}")
        if len(points) < 2:
            raise ValueError(f"LinkCosts.measured[{key!r}] needs at least 2 (nbytes, seconds) "
                             f"points, got {len(points)}")
        sizes = [n for n, _ in points]
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes) or \
                any(b <= a for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"LinkCosts.measured[{key!r}] sizes must be non-negative ints in "
                             f"strictly increasing order, got {sizes}")
        for _, t in points:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
                    math.isfinite(t) and t >= 0):
                raise ValueError(f"LinkCosts.measured[{key!r}] times must be finite seconds "
                                 f"≥ 0, got {t!r}")


def interpolate(points: Table, nbytes: float) -> float:
    """Seconds at ``nbytes`` by the local α-β line through the two nearest measured points,
    after each point is lowered to the least time measured at its size or above: the same
    algorithm never moves fewer bytes more slowly, so a small size timed above a larger one
    caught a slow spell (on this project's VM, 2.95 ms for a 4 KiB ring all-gather on 2
    ranks beside 1.67 ms at 1 MiB), and the larger size's time bounds it."""
    points = _monotone(points)
    i = 0
    while i < len(points) - 2 and nbytes > points[i + 1][0]:
        i += 1
    (n0, t0), (n1, t1) = points[i], points[i + 1]
    slope = (t1 - t0) / (n1 - n0)
    if nbytes < n0 or nbytes > n1:  # extrapolating: never let time fall with size
        slope = max(slope, 0.0)
        anchor_n, anchor_t = (n0, t0) if nbytes < n0 else (n1, t1)
        return max(0.0, anchor_t + (nbytes - anchor_n) * slope)
    return max(0.0, t0 + (nbytes - n0) * slope)


def _monotone(points: Table) -> Table:
    """``points`` with each time replaced by the least time at its size or any larger one."""
    out, least = [], math.inf
    for n, t in reversed(points):
        least = min(least, t)
        out.append((n, least))
    return tuple(reversed(out))


def tables_to_json(tables: tuple[tuple[str, Table], ...]) -> dict[str, Any]:
    return {key: [[n, t] for n, t in points] for key, points in tables}


def tables_from_json(data: Any) -> tuple[tuple[str, Table], ...]:
    if not isinstance(data, dict):
        raise ValueError(f"measured tables must be a JSON object, got {type(data).__name__}")
    return tuple(sorted((str(key), tuple((int(n), float(t)) for n, t in points))
                        for key, points in data.items()))
