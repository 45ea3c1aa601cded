"""The α-β-γ cost model that ``algorithm="auto"`` uses (Thakur, Rabenseifner & Gropp 2005).

A message of n bytes costs α + n·β (latency + inverse bandwidth); reducing n bytes costs
n·γ. Each algorithm's time is a closed form in p (ranks) and N (the collective's size in the
nccl-tests convention: the tensor for all_reduce/broadcast/reduce, the whole concatenated
buffer for all_gather/reduce_scatter/gather/scatter/all_to_all). Two refinements for ranks
that share a host's CPUs, where "the network" is the kernel copying bytes:

* a step in which a rank sends *and* receives at once (ring, halving/doubling, pairwise
  exchange) has its own ``alpha_exchange``/``beta_exchange``: both copies run on the same
  cores, and more threads wake at once;
* costs may be calibrated per world size (``by_world_size``): 4 ranks on 2 cores are not
  2 ranks on 2 cores;
* at a calibrated world size each algorithm's own measured times (``measured``, see
  :mod:`~disttrain.comm.cost_tables`) replace its closed form: piecewise α-β fits per
  algorithm, because on shared cores algorithms of the same shape differ in effective α, β.

``native`` (torch.distributed's own kernels, no Python per message) has its own α and β.
docs/cost_model.md explains the model and all_reduce's forms; :data:`_FORMULAS` below holds
every closed form; ``disttrain bench comm --calibrate`` measures the constants.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from disttrain import private_files
from disttrain.comm.cost_tables import (
    Table,
    interpolate,
    table_key,
    tables_from_json,
    tables_to_json,
    validate_tables,
)
from disttrain.comm.theory import theory_bytes_sent

__all__ = [
    "LinkCosts", "calibration_path", "choose", "costs_from_bytes", "costs_to_bytes",
    "formula_time", "load_costs", "native_fit", "predict", "save_costs", "theory_bytes_sent",
    "with_world_sizes",
]

log = logging.getLogger(__name__)
_FLOATS = ("alpha", "beta", "gamma", "native_alpha", "native_beta")
_OPTIONAL = ("alpha_exchange", "beta_exchange")


@dataclass(frozen=True)
class LinkCosts:
    """Measured (or default) costs of one transport, in seconds and seconds per byte."""

    alpha: float = 150e-6  # one-way message, including Python overhead
    beta: float = 1 / 1.5e9  # per byte of a one-way message
    gamma: float = 1 / 4e9  # per byte reduced
    alpha_exchange: float | None = None  # step sending and receiving at once; None: alpha
    beta_exchange: float | None = None  # per byte sent in such a step; None: beta
    native_alpha: float = 60e-6  # per step of torch.distributed's own algorithm
    native_beta: float = 1 / 1.5e9
    chunk_bytes: int = 4 << 20  # ring streaming sub-chunk (4 MiB measured best of 256K..16M)
    source: str = "defaults"
    by_world_size: tuple[tuple[int, LinkCosts], ...] = ()  # calibrated at these world sizes
    # each algorithm's own measured times at this entry's world size (docs: cost_tables.py);
    # read only through by_world_size, so they never apply to another world size
    measured: tuple[tuple[str, Table], ...] = ()

    def __post_init__(self) -> None:
        for name in (*_FLOATS, *_OPTIONAL):
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"LinkCosts.{name} must be a finite number ≥ 0 (seconds or "
                                 f"seconds per byte), got {value!r}")
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) \
                or self.chunk_bytes <= 0:
            raise ValueError(f"LinkCosts.chunk_bytes must be a positive int, got "
                             f"{self.chunk_bytes!r}")
        for p, entry in self.by_world_size:
            if not isinstance(p, int) or p < 1 or not isinstance(entry, LinkCosts) \
                    or entry.by_world_size:
                raise ValueError("LinkCosts.by_world_size must hold (world_size ≥ 1, LinkCosts "
                                 "without by_world_size) pairs")
        validate_tables(self.measured)

    @property
    def ax(self) -> float:
        return self.alpha if self.alpha_exchange is None else self.alpha_exchange

    @property
    def bx(self) -> float:
        return self.beta if self.beta_exchange is None else self.beta_exchange

    def at(self, p: int) -> LinkCosts:
        """The costs calibrated at world size ``p``, else at the nearest calibrated one
        (ties: the smaller), else these."""
        if not self.by_world_size:
            return self
        return min(self.by_world_size, key=lambda e: (abs(e[0] - p), e[0]))[1]

    def table(self, op: str, algorithm: str, p: int) -> Table | None:
        """``algorithm``'s measured times for ``op`` at exactly world size ``p``, if calibrated."""
        for q, entry in self.by_world_size:
            if q == p:
                return dict(entry.measured).get(table_key(op, algorithm))
        return None


def _log2(p: int) -> int:
    """⌈log₂ p⌉: rounds of a binomial tree."""
    return (p - 1).bit_length() if p > 1 else 0


def _pow2_floor(p: int) -> int:
    return 1 << (p.bit_length() - 1)


@dataclass(frozen=True)
class _Terms:
    """Everything a formula reads: p, N, and the costs (native's when predicting native)."""

    p: int
    n: float
    a: float
    b: float
    ax: float
    bx: float
    g: float
    chunk: int

    @property
    def lg(self) -> int:
        return _log2(self.p)

    @property
    def frac(self) -> float:
        return (self.p - 1) / self.p

    @property
    def q(self) -> int:  # recursive halving/doubling works on the largest power of two ≤ p
        return _pow2_floor(self.p)

    @property
    def fold(self) -> int:  # 1 when p is not a power of two: a fold step and an unfold step
        return 0 if self.q == self.p else 1


_Formula = Callable[[_Terms], float]
_FORMULAS: dict[tuple[str, str], _Formula] = {
    # all_reduce
    ("all_reduce", "naive"): lambda t: (t.p - 1) * (t.ax + t.n * t.bx + t.n * t.g),
    # streaming hides the reduction of all but the last sub-chunk of each reduce-scatter step
    ("all_reduce", "ring"): lambda t: 2 * (t.p - 1) * t.ax + 2 * t.frac * t.n * t.bx
    + (t.p - 1) * min(t.n / t.p, t.chunk) * t.g,
    ("all_reduce", "tree"): lambda t: 2 * t.lg * (t.a + t.n * t.b) + t.lg * t.n * t.g,
    ("all_reduce", "halving_doubling"): lambda t: 2 * _log2(t.q) * t.ax
    + 2 * (t.q - 1) / t.q * t.n * t.bx + (t.q - 1) / t.q * t.n * t.g
    + t.fold * (2 * (t.a + t.n * t.b) + t.n * t.g),
    # one-to-all and all-to-one (one-way steps)
    ("broadcast", "naive"): lambda t: (t.p - 1) * (t.a + t.n * t.b),
    ("broadcast", "tree"): lambda t: t.lg * (t.a + t.n * t.b),
    ("reduce", "naive"): lambda t: (t.p - 1) * (t.a + t.n * t.b + t.n * t.g),
    ("reduce", "tree"): lambda t: t.lg * (t.a + t.n * t.b + t.n * t.g),
    ("gather", "naive"): lambda t: (t.p - 1) * t.a + t.frac * t.n * t.b,
    ("gather", "tree"): lambda t: t.lg * t.a + t.frac * t.n * t.b,
    ("scatter", "naive"): lambda t: (t.p - 1) * t.a + t.frac * t.n * t.b,
    ("scatter", "tree"): lambda t: t.lg * t.a + t.frac * t.n * t.b,
    # all-to-all patterns (exchange steps)
    ("all_gather", "naive"): lambda t: (t.p - 1) * t.ax + t.frac * t.n * t.bx,
    ("all_gather", "ring"): lambda t: (t.p - 1) * t.ax + t.frac * t.n * t.bx,
    ("all_gather", "halving_doubling"): lambda t: _log2(t.q) * t.ax + t.frac * t.n * t.bx
    + t.fold * (2 * t.a + (t.n / t.p + t.n) * t.b),
    ("reduce_scatter", "naive"): lambda t: (t.p - 1) * t.ax + t.frac * t.n * (t.bx + t.g),
    ("reduce_scatter", "ring"): lambda t: (t.p - 1) * t.ax + t.frac * t.n * t.bx
    + (t.p - 1) * min(t.n / t.p, t.chunk) * t.g,
    ("reduce_scatter", "halving_doubling"): lambda t: _log2(t.q) * t.ax
    + t.frac * t.n * (t.bx + t.g) + t.fold * (2 * t.a + (t.n + t.n / t.p) * t.b + t.n * t.g),
    ("all_to_all", "naive"): lambda t: (t.p - 1) * t.ax + t.frac * t.n * t.bx,
    ("barrier", "naive"): lambda t: 2 * (t.p - 1) * t.a,
    ("barrier", "tree"): lambda t: 2 * t.lg * t.a,
}

# Which closed form torch.distributed's own algorithm follows, for the ``native`` entry.
_NATIVE_SHAPE = {
    "all_reduce": "halving_doubling", "broadcast": "tree", "reduce": "tree", "gather": "naive",
    "scatter": "naive", "all_gather": "ring", "reduce_scatter": "ring", "all_to_all": "naive",
    "barrier": "tree",
}


def predict(op: str, algorithm: str, p: int, nbytes: int, costs: LinkCosts) -> float:
    """Predicted seconds for one collective: the algorithm's measured table at world size
    ``p`` when calibration made one, else its closed form; KeyError for an unknown pair."""
    table = costs.table(op, algorithm, p) if p > 1 else None
    if table is not None:
        return interpolate(table, nbytes)
    return formula_time(op, algorithm, p, nbytes, costs)


def formula_time(op: str, algorithm: str, p: int, nbytes: int, costs: LinkCosts) -> float:
    """The closed form alone (docs/cost_model.md); raises KeyError for an unknown pair."""
    if algorithm == "native":
        formula = _FORMULAS[(op, _NATIVE_SHAPE[op])]
    else:
        formula = _FORMULAS[(op, algorithm)]
    if p <= 1:
        return 0.0
    c = costs.at(p)
    if algorithm == "native":
        na, nb = c.native_alpha, c.native_beta
        return formula(_Terms(p, float(nbytes), na, nb, na, nb, c.gamma, c.chunk_bytes))
    return formula(_Terms(p, float(nbytes), c.alpha, c.beta, c.ax, c.bx, c.gamma,
                          c.chunk_bytes))


def choose(op: str, p: int, nbytes: int, costs: LinkCosts, candidates: list[str]) -> str:
    """The candidate with the lowest predicted time (ties: the earlier candidate); candidates
    without a formula are skipped. When some candidates have measured tables at ``p``, only
    those compete: a measurement and a closed form are not comparable estimates."""
    timed = [name for name in candidates if costs.table(op, name, p) is not None]
    best, best_t = candidates[0], math.inf
    for name in timed or candidates:
        try:
            t = predict(op, name, p, nbytes, costs)
        except KeyError:
            continue
        if t < best_t:
            best, best_t = name, t
    return best


def native_fit(p: int, small: tuple[int, float], large: tuple[int, float],
               gamma: float) -> tuple[float, float]:
    """(native_alpha, native_beta) such that ``predict("all_reduce", "native", p, n)`` passes
    through both measured points ``(n, seconds)``; clamped at zero."""
    def coefficients(n: int) -> list[float]:
        # predict is linear in (native_alpha, native_beta, gamma): read the coefficients off
        # unit costs
        return [predict("all_reduce", "native", p, n, LinkCosts(
            native_alpha=a, native_beta=b, gamma=g, alpha=0, beta=0))
            for a, b, g in ((1, 0, 0), (0, 1, 0), (0, 0, 1))]

    (n1, t1), (n2, t2) = small, large
    (a1, b1, c1), (a2, b2, c2) = coefficients(n1), coefficients(n2)
    r1, r2 = t1 - c1 * gamma, t2 - c2 * gamma
    det = a1 * b2 - a2 * b1
    if p < 2 or det == 0:
        raise ValueError(f"cannot fit native costs from sizes {n1} and {n2} on {p} ranks; "
                         f"use two different sizes and at least 2 ranks")
    beta = max(0.0, (a1 * r2 - a2 * r1) / det)
    return max(0.0, (r1 - b1 * beta) / a1), beta


# ---------------------------------------------------------------------------- storage
def calibration_path() -> Path:
    """Where calibrated costs live: $DISTTRAIN_CALIBRATION, else ~/.cache/disttrain/."""
    env = os.environ.get("DISTTRAIN_CALIBRATION")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "disttrain" / "calibration.json"


def _to_json(costs: LinkCosts) -> dict[str, Any]:
    data = {f.name: getattr(costs, f.name) for f in fields(costs)
            if f.name not in ("by_world_size", "measured")}
    data["by_world_size"] = {str(p): _to_json(entry) for p, entry in costs.by_world_size}
    if costs.measured:
        data["measured"] = tables_to_json(costs.measured)
    return data


def _from_json(entry: dict[str, Any]) -> LinkCosts:
    known = {f.name for f in fields(LinkCosts)} - {"by_world_size", "measured"}
    by_p = entry.get("by_world_size") or {}
    return LinkCosts(**{k: v for k, v in entry.items() if k in known},
                     by_world_size=tuple(sorted((int(p), _from_json(e)) for p, e in by_p.items())),
                     measured=tables_from_json(entry.get("measured") or {}))


def costs_to_bytes(costs: LinkCosts) -> bytes:
    """JSON encoding of ``costs`` (sent by rank 0 so every rank's ``auto`` agrees)."""
    return json.dumps(_to_json(costs), sort_keys=True).encode()


def costs_from_bytes(data: bytes) -> LinkCosts:
    """Inverse of :func:`costs_to_bytes`; JSON only, never pickle."""
    return _from_json(json.loads(data.decode()))


def load_costs(transport: str, path: Path | None = None) -> LinkCosts:
    """Stored costs for ``transport``, or the defaults when none are stored (or unreadable)."""
    path = path or calibration_path()
    try:
        stored = json.loads(path.read_text())
        if isinstance(stored, dict) and transport not in stored:
            log.debug("no calibration for %r in %s; using default costs", transport, path)
            return LinkCosts()  # calibrated for another transport only: nothing is wrong
        return _from_json(stored[transport])
    except FileNotFoundError:
        return LinkCosts()
    except (OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring calibration for %r in %s (%s: %s); using default costs",
                    transport, path, type(exc).__name__, exc)
        return LinkCosts()


def save_costs(transport: str, costs: LinkCosts, path: Path | None = None) -> Path:
    """Store ``costs`` for ``transport``, keeping other transports' entries."""
    path = path or calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[transport] = _to_json(costs)
    return private_files.write_text(path, json.dumps(data, indent=2) + "\n")  # never via a link


def with_world_sizes(base: LinkCosts, entries: dict[int, LinkCosts]) -> LinkCosts:
    """``base`` carrying per-world-size entries (each stripped of its own entries)."""
    return replace(base, by_world_size=tuple(sorted(
        (p, replace(e, by_world_size=())) for p, e in entries.items())))

