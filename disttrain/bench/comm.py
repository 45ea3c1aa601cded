"""``disttrain bench comm``: every collective × algorithm × size × world size, nccl-tests style.

For each world size the parent starts that many local ranks (:mod:`disttrain.bench.ranks`),
which time the planned cases (:mod:`disttrain.bench.comm_job`) and report per-rank times;
this module turns the reports into rows: slowest rank per iteration, p50/p99, algbw/busbw,
bytes sent per rank (counted) against theory (:func:`~disttrain.comm.cost_model.
theory_bytes_sent`), the cost model's prediction, and whether every result was right.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from disttrain.bench import cases
from disttrain.bench.comm_job import Timing, run_plan
from disttrain.bench.ranks import RankGroup
from disttrain.bench.timing import bandwidths, copy_bandwidth, percentile, slowest_rank
from disttrain.bench.transports import check_transport
from disttrain.bench.units import size_range
from disttrain.comm import ALGORITHMS
from disttrain.comm.cost_model import LinkCosts, load_costs, predict, theory_bytes_sent

DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DEFAULT_SIZES = tuple(size_range(4 << 10, 64 << 20, 16))  # 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB
DEFAULT_WORLD_SIZES = (2, 4)
Row = dict[str, Any]


def _names(values: Sequence[str]) -> str:
    return ", ".join(values)


@dataclass(frozen=True)
class CommBenchConfig:
    """What to measure. ``algorithms=None`` means every registered algorithm plus ``auto``."""

    ops: tuple[str, ...] = DEFAULT_OPS
    algorithms: tuple[str, ...] | None = None
    sizes: tuple[int, ...] = DEFAULT_SIZES
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    transport: str = "torch"
    iters: int = 20
    warmup: int = 1
    budget_s: float = 0.5
    timeout_s: float = 60.0
    shared_buffers: bool = False  # in-place cases on Communicator.shared_zeros tensors
    interleave: bool = False  # time a size's algorithms call by call, not block by block
    bind_cores: bool = False  # pin each rank to a core of its own (when ranks ≤ cores)

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in cases.BENCHMARKED_OPS]
        if unknown or not self.ops:
            raise ValueError(f"unknown or missing ops {unknown}; choose from: "
                             f"{_names(cases.BENCHMARKED_OPS)}")
        if self.algorithms is not None:
            known = {"auto", *(name for op in self.ops for name in ALGORITHMS[op])}
            bad = [a for a in self.algorithms if a not in known]
            if bad or not self.algorithms:
                raise ValueError(f"unknown or missing algorithms {bad} for ops "
                                 f"{_names(self.ops)}; choose from: {_names(sorted(known))}")
        if not self.sizes or min(self.sizes) <= 0:
            raise ValueError("sizes must be positive byte counts, e.g. --sizes 4KiB,16MiB")
        if not self.world_sizes or min(self.world_sizes) < 2:
            raise ValueError(f"world sizes must be ≥ 2 (one rank moves nothing), got "
                             f"{list(self.world_sizes)}")
        check_transport(self.transport)
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"need iters ≥ 1 and warmup ≥ 0, got {self.iters}, {self.warmup}")
        if self.budget_s < 0 or self.timeout_s <= 0:
            raise ValueError("budget must be ≥ 0 seconds (0: always run iters) and timeout > 0")

    def algorithms_for(self, op: str) -> list[str]:
        registered = [*ALGORITHMS[op], "auto"]
        if self.algorithms is None:
            return registered
        return [a for a in self.algorithms if a in registered]


def plan(config: CommBenchConfig) -> list[tuple[str, str, int]]:
    """[(op, algorithm, nbytes)] for one world size, grouped by (op, size)."""
    return [(op, algorithm, size) for op in config.ops for size in config.sizes
            for algorithm in config.algorithms_for(op)]


def make_row(op: str, algorithm: str, p: int, per_rank: list[dict[str, Any]],
             costs: Callable[[str], LinkCosts] = load_costs) -> Row:
    """One table/JSON row from every rank's report of one case; ``costs(transport)`` gives
    the cost model's constants for the ``model_s`` column."""
    times = slowest_rank([r["times"] for r in per_rank])
    nbytes, chosen, transport = (per_rank[0][k] for k in ("nbytes", "chosen", "transport"))
    p50, p99 = percentile(times, 50), percentile(times, 99)
    algbw, busbw = bandwidths(op, p, nbytes, p50)
    observed = chosen != "native"
    model_s = _or_none(lambda: predict(op, chosen, p, nbytes, costs(transport)))
    return {
        "op": op, "algorithm": algorithm, "chosen": chosen, "transport": transport,
        "world_size": p, "bytes": nbytes, "iters": len(times),
        "time_p50_s": p50, "time_p99_s": p99, "time_min_s": min(times),
        "time_mean_s": sum(times) / len(times),
        "algbw_GBps": algbw, "busbw_GBps": busbw,
        "bytes_sent_per_rank": max(r["bytes_sent"] for r in per_rank) if observed else None,
        "theory_bytes_per_rank": _or_none(lambda: theory_bytes_sent(op, chosen, p, nbytes)),
        "model_s": model_s,
        "correct": all(r["correct"] for r in per_rank),
        "shared_buffers": bool(per_rank[0].get("shared_buffers", False)),
        "interleaved": bool(per_rank[0].get("interleaved", False)),
    }


def _or_none(formula: Callable[[], float | None]) -> float | None:
    """The formula's value, or None when the cost model has none for this algorithm."""
    try:
        return formula()
    except KeyError:
        return None


COPY_BYTES = 64 << 20


def copy_row(p: int, transport: str, seconds: float, gbps: float) -> Row:
    """The reference row ``op="copy"``: one core copying 64 MiB (``np.copyto``), measured by
    the parent before any rank starts, printed after the largest all_reduce of each world
    size so that shared-memory busbw reads against it. Its algbw and busbw are the copy's
    GB/s; it moves nothing between ranks."""
    return {
        "op": "copy", "algorithm": "np.copyto 1 core", "chosen": "np.copyto 1 core",
        "transport": transport, "world_size": p, "bytes": COPY_BYTES, "iters": 1,
        "time_p50_s": seconds, "time_p99_s": seconds, "time_min_s": seconds,
        "time_mean_s": seconds,
        "algbw_GBps": gbps, "busbw_GBps": gbps, "bytes_sent_per_rank": None,
        "theory_bytes_per_rank": None, "model_s": None, "correct": True,
    }


def copy_after(cases_p: list[tuple[str, str, int]]) -> int:
    """Index of the case after which the copy reference row goes: the last all_reduce (at
    the largest size: cases are grouped by size, in the order given), else the last case."""
    reduces = [i for i, (op, _, _) in enumerate(cases_p) if op == "all_reduce"]
    return reduces[-1] if reduces else len(cases_p) - 1


def run(config: CommBenchConfig, on_row: Callable[[Row], None] = lambda row: None,
        on_skip: Callable[[str], None] = lambda why: None) -> list[Row]:
    """Run every world size in turn; ``on_row`` sees each row as soon as it is measured,
    ``on_skip`` the reason for each algorithm that cannot run on this transport. With a
    shared-memory transport (``shm``, ``auto``) a :func:`copy_row` follows the largest
    all_reduce of each world size (it is not part of the returned rows)."""
    costs = functools.cache(load_costs)
    timing = Timing(config.iters, config.warmup, config.budget_s)
    copy = copy_bandwidth(COPY_BYTES) if config.transport != "torch" else None
    rows: list[Row] = []
    for p in config.world_sizes:
        cases_p = plan(config)
        copy_at = copy_after(cases_p) if copy is not None else -1

        def describe(i: int, cases_p: list[tuple[str, str, int]] = cases_p, p: int = p) -> str:
            if i >= len(cases_p):
                return f"shutdown of {p} ranks"
            op, algorithm, nbytes = cases_p[i]
            return f"{op} algorithm={algorithm} bytes={nbytes} world_size={p}"

        with RankGroup(p, run_plan, (cases_p, timing, config.shared_buffers, config.interleave),
                       transport=config.transport, timeout_s=config.timeout_s,
                       describe=describe, bind_cores=config.bind_cores) as group:
            for i, ((op, algorithm, _), per_rank) in enumerate(zip(cases_p, group.reports())):
                if "skipped" in per_rank[0]:
                    on_skip(f"{op}/{algorithm}: {per_rank[0]['skipped']}")
                else:
                    row = make_row(op, algorithm, p, per_rank, costs)
                    rows.append(row)
                    on_row(row)
                if i == copy_at and copy is not None:
                    on_row(copy_row(p, per_rank[0].get("transport", config.transport), *copy))
    return rows
