"""What is being trained, and how: batch, precision, optimizer, strategy options, and the
distribution of worker speeds (stragglers).

Worker speeds: each worker's compute takes ``factor`` × the profile's time. A job of W
workers is represented by at most ``MAX_REPRESENTATIVES`` (factor, weight) pairs whose
weights sum to W, always including the expected slowest worker, which is what a
synchronous step waits for. Specs::

    none                  every worker at speed 1
    lognormal:0.1         factor = exp(0.1·z), z standard normal (median 1)
    straggler:0.01:3      1% of the workers (rounded, at least one if > 0) take 3× as long
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

PRECISIONS = {"fp32": 4, "bf16": 2}  # bytes per parameter and per gradient element
OPTIMIZERS = ("sgd", "adam")
# how pipeline stages are cut: "params" balances parameters (disttrain's default, what
# `disttrain train`/`bench` run), "time" balances the profiled forward+backward time
PARTITIONS = ("params", "time")
MAX_REPRESENTATIVES = 32


def optimizer_bytes(optimizer: str, precision: str) -> int:
    """K, bytes per parameter of optimizer state (fp32 master weights included for bf16):
    SGD momentum 4 (+4), Adam 8 (+4): the ZeRO paper's K = 12 for mixed-precision Adam."""
    state = 4 if optimizer == "sgd" else 8
    return state + (4 if precision == "bf16" else 0)


@dataclass(frozen=True)
class Speeds:
    """A distribution of worker compute-time factors (see the module docstring)."""

    kind: str = "none"
    sigma: float = 0.0
    fraction: float = 0.0
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "lognormal", "straggler"):
            raise ValueError(f"speeds: unknown kind {self.kind!r}; use none, lognormal:SIGMA "
                             f"or straggler:FRACTION:FACTOR")
        if self.sigma < 0 or not 0 <= self.fraction <= 1 or self.factor < 1:
            raise ValueError(f"speeds: need sigma ≥ 0, 0 ≤ fraction ≤ 1, factor ≥ 1; got "
                             f"{self.sigma}, {self.fraction}, {self.factor}")

    @classmethod
    def parse(cls, text: str) -> Speeds:
        parts = text.split(":")
        try:
            if parts[0] == "none" and len(parts) == 1:
                return cls()
            if parts[0] == "lognormal" and len(parts) == 2:
                return cls("lognormal", sigma=float(parts[1]))
            if parts[0] == "straggler" and len(parts) == 3:
                return cls("straggler", fraction=float(parts[1]), factor=float(parts[2]))
        except ValueError:
            pass
        raise ValueError(f"--worker-speeds {text!r}: use none, lognormal:SIGMA (e.g. "
                         f"lognormal:0.05) or straggler:FRACTION:FACTOR (e.g. straggler:0.01:3)")

    def representatives(self, workers: int) -> list[tuple[float, float]]:
        """(factor, weight) pairs, fastest first, weights summing to ``workers``."""
        if self.kind == "none" or (workers == 1 and self.kind == "straggler"):
            return [(1.0, float(workers))]
        if self.kind == "straggler":
            slow = min(workers, max(1 if self.fraction > 0 else 0,
                                    round(self.fraction * workers)))
            pairs = [(1.0, float(workers - slow)), (self.factor, float(slow))]
            return [p for p in pairs if p[1] > 0]
        normal = NormalDist()
        if workers <= MAX_REPRESENTATIVES:
            return [(math.exp(self.sigma * normal.inv_cdf((i + 0.5) / workers)), 1.0)
                    for i in range(workers)]
        k = MAX_REPRESENTATIVES - 1  # buckets for all but the slowest worker
        top = 1 - 1 / workers
        pairs = [(math.exp(self.sigma * normal.inv_cdf((i + 0.5) / k * top)),
                  (workers - 1) / k) for i in range(k)]
        return [*pairs, (self.slowest(workers), 1.0)]

    def slowest(self, workers: int) -> float:
        """The expected slowest worker's factor among ``workers`` (Hazen's plotting position
        (W − 0.5)/W for the maximum)."""
        if self.kind == "none":
            return 1.0
        if self.kind == "straggler":
            return self.factor if self.fraction > 0 and workers > 1 else 1.0
        return math.exp(self.sigma * NormalDist().inv_cdf((workers - 0.5) / workers)) \
            if workers > 1 else 1.0


@dataclass(frozen=True)
class Workload:
    """How the model trains. ``global_batch`` None: ``batch_per_worker`` × workers (weak
    scaling, as in Horovod's measurements); set it to hold the global batch fixed."""

    batch_per_worker: int = 32
    global_batch: int | None = None
    precision: str = "fp32"
    optimizer: str = "sgd"
    algorithm: str = "auto"
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    microbatches: int = 8
    pp_size: int | None = None  # None: min(workers, layers, 8)
    dp_shard: int | None = None  # ZeRO: hybrid sharding in groups of this many ranks (None: all)
    partition: str = "params"  # pipeline stages: as disttrain's pipelines split (PARTITIONS)
    servers: int | None = None  # parameter servers; None: max(1, workers // 8)
    staleness: int = 2
    clocks: int = 6  # parameter-server clocks simulated per worker
    speeds: Speeds = Speeds()

    def __post_init__(self) -> None:
        for name in ("batch_per_worker", "microbatches", "clocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
        for name in ("global_batch", "pp_size", "servers", "dp_shard"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be an integer ≥ 1 or None, got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got "
                             f"{self.optimizer!r}")
        if not self.bucket_mb > 0 or not self.first_bucket_mb > 0:
            raise ValueError("bucket_mb and first_bucket_mb must be > 0 MiB")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, got "
                             f"{self.partition!r}")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) \
                or self.staleness < 0:
            raise ValueError(f"staleness must be an integer ≥ 0, got {self.staleness!r}")

    def batch(self, workers: int) -> int:
        return self.global_batch or self.batch_per_worker * workers

    @property
    def element_bytes(self) -> int:
        return PRECISIONS[self.precision]

    @property
    def k_bytes(self) -> int:
        return optimizer_bytes(self.optimizer, self.precision)
