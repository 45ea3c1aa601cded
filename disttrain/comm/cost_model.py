"""The α-β-γ cost model that ``algorithm="auto"`` uses (Thakur, Rabenseifner & Gropp 2005).

A message of n bytes costs α + n·β (latency + inverse bandwidth); reducing n bytes costs
n·γ. Each algorithm's time is a closed form in p (ranks) and N (the collective's size in the
nccl-tests convention: the tensor for all_reduce/broadcast/reduce, the whole concatenated
buffer for all_gather/reduce_scatter/gather/scatter/all_to_all). The formulas are written
out in docs/cost_model.md. ``native`` (torch.distributed's own kernels, no Python per
message) gets its own α and β, measured by ``disttrain bench comm --calibrate``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class LinkCosts:
    """Measured (or default) costs of one transport, in seconds and seconds per byte."""

    alpha: float = 150e-6  # per point-to-point message, including Python overhead
    beta: float = 1 / 1.5e9  # per byte sent
    gamma: float = 1 / 4e9  # per byte reduced
    native_alpha: float = 60e-6  # per step of torch.distributed's own algorithm
    native_beta: float = 1 / 1.5e9
    chunk_bytes: int = 1 << 20  # ring streaming sub-chunk
    source: str = "defaults"

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "native_alpha", "native_beta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"LinkCosts.{name} must be a finite non-negative number, got {value}")
        if self.chunk_bytes <= 0:
            raise ValueError(f"LinkCosts.chunk_bytes must be positive, got {self.chunk_bytes}")


def _log2(p: int) -> int:
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


def _fold(p: int) -> int:
    """1 when p is not a power of two (recursive halving/doubling pays a fold and unfold)."""
    return 0 if p & (p - 1) == 0 else 1


def predict(op: str, algorithm: str, p: int, nbytes: int, c: LinkCosts) -> float:
    """Predicted seconds for one collective; raises KeyError for an unknown pair."""
    if p <= 1:
        return 0.0
    a, b, g, n, lg = c.alpha, c.beta, c.gamma, float(nbytes), _log2(p)
    frac = (p - 1) / p
    if algorithm == "native":
        a, b = c.native_alpha, c.native_beta
        algorithm = _NATIVE_SHAPE[op]
    if algorithm == "ring" and op == "all_reduce":
        # Thakur's 2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ, except that streaming in sub-chunks
        # hides the reduction of all but the last sub-chunk of each of the p−1 steps.
        hidden_gamma = (p - 1) * min(n / p, c.chunk_bytes) * g
        return 2 * (p - 1) * a + 2 * frac * n * b + hidden_gamma
    formulas = {
        ("all_reduce", "naive"): (p - 1) * a + (p - 1) * n * b + (p - 1) * n * g,
        ("all_reduce", "tree"): 2 * lg * (a + n * b) + lg * n * g,
        ("all_reduce", "halving_doubling"): 2 * lg * a + 2 * frac * n * b + frac * n * g
        + _fold(p) * (2 * (a + n * b) + n * g),
        ("broadcast", "naive"): (p - 1) * (a + n * b),
        ("broadcast", "tree"): lg * (a + n * b),
        ("reduce", "naive"): (p - 1) * (a + n * b) + (p - 1) * n * g,
        ("reduce", "tree"): lg * (a + n * b + n * g),
        ("gather", "naive"): (p - 1) * a + frac * n * b,
        ("gather", "tree"): lg * a + frac * n * b,
        ("scatter", "naive"): (p - 1) * a + frac * n * b,
        ("scatter", "tree"): lg * a + frac * n * b,
        ("all_gather", "naive"): (p - 1) * a + frac * n * b,
        ("all_gather", "ring"): (p - 1) * a + frac * n * b,
        ("all_gather", "halving_doubling"): lg * a + frac * n * b
        + _fold(p) * 2 * (a + n / p * b),
        ("reduce_scatter", "naive"): (p - 1) * a + frac * n * (b + g),
        ("reduce_scatter", "ring"): (p - 1) * a + frac * n * (b + g),
        ("reduce_scatter", "halving_doubling"): lg * a + frac * n * (b + g)
        + _fold(p) * (2 * a + n * b + n * g),
        ("all_to_all", "naive"): (p - 1) * a + frac * n * b,
        ("barrier", "naive"): 2 * (p - 1) * a,
        ("barrier", "tree"): 2 * lg * a,
    }
    return formulas[(op, algorithm)]


# Which closed form torch.distributed's own algorithm follows, for the ``native`` entry.
_NATIVE_SHAPE = {
    "all_reduce": "halving_doubling", "broadcast": "tree", "reduce": "tree", "gather": "naive",
    "scatter": "naive", "all_gather": "ring", "reduce_scatter": "ring", "all_to_all": "naive",
    "barrier": "tree",
}


def choose(op: str, p: int, nbytes: int, costs: LinkCosts, candidates: list[str]) -> str:
    """The candidate with the lowest predicted time (ties: the earlier candidate)."""
    best, best_t = candidates[0], math.inf
    for name in candidates:
        try:
            t = predict(op, name, p, nbytes, costs)
        except KeyError:
            continue
        if t < best_t:
            best, best_t = name, t
    return best


def calibration_path() -> Path:
    """Where calibrated costs live: $DISTTRAIN_CALIBRATION, else ~/.cache/disttrain/."""
    env = os.environ.get("DISTTRAIN_CALIBRATION")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "disttrain" / "calibration.json"


def load_costs(transport: str, path: Path | None = None) -> LinkCosts:
    """Stored costs for ``transport``, or the defaults when none are stored (or unreadable)."""
    path = path or calibration_path()
    try:
        data = json.loads(path.read_text())
        entry = data[transport]
        fields = {k: entry[k] for k in LinkCosts.__dataclass_fields__ if k in entry}
        return LinkCosts(**fields)
    except (OSError, KeyError, ValueError, TypeError):
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
    data[transport] = asdict(costs)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path
