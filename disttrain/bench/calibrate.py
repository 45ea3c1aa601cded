"""``disttrain bench comm --calibrate``: measure the cost model's constants on this machine.

For each world size p, p local ranks run these, with every rank busy at once (ranks 2i and
2i+1 are partners), so the costs include the sharing of cores that p ranks cause:

* α, β (one-way): ping-pong of 4 B, 1 MiB and 16 MiB through the
  :class:`~disttrain.comm.context.CollectiveContext` path every algorithm's messages take
  (Python overhead included): α = half the 4-byte round trip; β = the slope
  ``(t(16 MiB) − t(1 MiB)) / 15 MiB`` of the one-way time, so α cancels;
* alpha_exchange, beta_exchange: the same with both partners sending at once
  (``ctx.sendrecv``, the step of ring and halving/doubling);
* γ: ``a.add_(b)`` on 16 MiB float32, per byte (the kernel the reductions run);
* native_alpha, native_beta: fitted (:func:`~disttrain.comm.cost_model.native_fit`) so that
  the model's native all_reduce equals torch.distributed's, timed at 4 KiB and 16 MiB;
* each algorithm's own table (:mod:`~disttrain.comm.cost_tables`): all_reduce, all_gather,
  reduce_scatter and broadcast timed with every registered algorithm at a few sizes, the
  way ``disttrain bench comm`` times them (same job, same barrier, slowest rank, median).
  With those, ``auto`` at this world size compares measured algorithms, not closed forms.

Latencies on a shared host are bimodal (a message either goes through at once or waits for a
scheduler tick), so each constant is a mean with the slowest 5% trimmed: the model adds step
costs, and means add where medians do not.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from disttrain.bench.comm_job import Timing, run_plan
from disttrain.bench.ranks import RankGroup
from disttrain.bench.timing import percentile, slowest_rank
from disttrain.comm import Communicator, algorithms
from disttrain.comm.context import CollectiveContext
from disttrain.comm.cost_model import LinkCosts, native_fit, save_costs, with_world_sizes
from disttrain.comm.cost_tables import Table, table_key
from disttrain.comm.selection import AUTO_NEVER

log = logging.getLogger(__name__)
TINY, LARGE_A, LARGE_B = 4, 1 << 20, 16 << 20
NATIVE_SMALL, NATIVE_LARGE = 4 << 10, 16 << 20
Samples = dict[str, list[float]]
KiB, MiB = 1 << 10, 1 << 20
TABLE_SIZES = {
    "all_reduce": (4 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB),
    "all_gather": (4 * KiB, 1 * MiB, 16 * MiB),
    "reduce_scatter": (4 * KiB, 1 * MiB, 16 * MiB),
    "broadcast": (4 * KiB, 1 * MiB, 16 * MiB),
}
TABLE_TIMING = Timing(iters=100, warmup=1, budget_s=0.5)  # per algorithm, interleaved: the
# median of 15-25 calls at p = 4 on 2 cores could not tell tree from naive at small sizes
Plan = list[tuple[str, str, int]]




def table_plan() -> Plan:
    """Every (op, algorithm, size) the tables time; algorithms that cannot run on the
    transport (``shm`` on torch, ``native`` without a group) are skipped by the job."""
    return [(op, name, n) for op, sizes in TABLE_SIZES.items() for n in sizes
            for name in algorithms.names(op) if name not in AUTO_NEVER]


def trimmed_mean(values: list[float], trim: float = 0.05) -> float:
    """Mean of ``values`` without the slowest ``trim`` fraction (preemptions)."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    keep = ordered[: max(1, len(ordered) - int(len(ordered) * trim))]
    return sum(keep) / len(keep)


def _times(fn: Callable[[], None], reps: int) -> list[float]:
    fn()  # warm-up: first-touch pages, connection set-up
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def _pair_traffic(comm: Communicator, nbytes: int, reps: int, exchange: bool) -> list[float]:
    """Round trips (ping-pong) or exchanges with the partner rank; [] without a partner."""
    partner = comm.rank ^ 1
    if partner >= comm.world_size:
        return []
    ctx = CollectiveContext(comm.transport, comm.stats, op="calibrate", seq=0,
                            algorithm="exchange" if exchange else "ping_pong",
                            timeout_s=comm.config.timeout_s, chunk_bytes=nbytes, tag_base=0)
    out, into = torch.zeros(max(1, nbytes // 4)), torch.zeros(max(1, nbytes // 4))
    first = comm.rank % 2 == 0

    def step() -> None:
        if exchange:
            ctx.sendrecv(out, partner, into, partner)
        elif first:
            ctx.send(out, partner)
            ctx.recv(into, partner)
        else:
            ctx.recv(into, partner)
            ctx.send(out, partner)

    return _times(step, reps)


def _add_times(nbytes: int, reps: int) -> list[float]:
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)

    def add() -> None:
        a.add_(b)

    return _times(add, reps)


def _native_times(comm: Communicator, nbytes: int, reps: int) -> list[float]:
    """Native all_reduce started together (after a barrier), timed like the benchmark."""
    buf = torch.zeros(nbytes // 4)
    samples = []
    for i in range(reps + 1):
        comm.barrier(algorithm="native")
        start = time.perf_counter()
        comm.all_reduce(buf, algorithm="native")
        if i:  # the first call warms up
            samples.append(time.perf_counter() - start)
    return samples


def measure(comm: Communicator, emit: Callable[[Any], None], reps: int) -> None:
    """The job on each rank: emit this rank's raw samples."""
    comm.expect_workload("collectives")  # the prices DDP and ZeRO will pay
    samples: Samples = {}
    for exchange in (False, True):
        kind = "exchange" if exchange else "ping_pong"
        comm.barrier(algorithm="native")
        samples[f"{kind}_tiny"] = _pair_traffic(comm, TINY, reps * 10, exchange)
        samples[f"{kind}_a"] = _pair_traffic(comm, LARGE_A, reps, exchange)
        samples[f"{kind}_b"] = _pair_traffic(comm, LARGE_B, reps, exchange)
    comm.barrier(algorithm="native")
    samples["add"] = _add_times(LARGE_B, reps)
    samples["native_small"] = _native_times(comm, NATIVE_SMALL, reps * 5)
    samples["native_large"] = _native_times(comm, NATIVE_LARGE, reps)
    emit(samples)
    # one report per (op, algorithm, size); interleaved, so that the algorithms of one size
    # are compared under the same load (what auto's choice rests on)
    run_plan(comm, emit, table_plan(), TABLE_TIMING, interleave=True)


def fit_tables(plan: Plan, results: list[list[dict[str, Any]]]) -> tuple[tuple[str, Table], ...]:
    """Measured tables from the job's per-case reports (``results[i]``: every rank's report
    for ``plan[i]``): the median over iterations of the slowest rank's time. An algorithm
    that computed a wrong result gets no table (a warning says so), so ``auto`` skips it."""
    points: dict[str, list[tuple[int, float]]] = {}
    wrong: set[str] = set()
    for (op, name, _), per_rank in zip(plan, results, strict=True):
        if "skipped" in per_rank[0]:
            continue
        if not all(r["correct"] for r in per_rank):
            log.warning("calibration: %s with %s gave a wrong result: no table for it, so auto "
                        "will not pick it; run `disttrain bench comm --ops %s --algorithms %s`",
                        op, name, op, name)
            wrong.add(table_key(op, name))
            continue
        seconds = percentile(slowest_rank([r["times"] for r in per_rank]), 50)
        points.setdefault(table_key(op, name), []).append((int(per_rank[0]["nbytes"]), seconds))
    return tuple(sorted((key, tuple(sorted(pts))) for key, pts in points.items()
                        if len(pts) >= 2 and key not in wrong))


def fit(p: int, per_rank: list[Samples], chunk_bytes: int) -> LinkCosts:
    """Costs for world size ``p`` from every rank's samples (pure; tested on its own)."""
    paired = [s for s in per_rank if s["ping_pong_tiny"]]
    if not paired:
        raise ValueError("no rank had a partner: calibration needs at least 2 ranks")

    def mean_of(key: str, scale: float = 1.0) -> float:
        return trimmed_mean([t * scale for s in paired for t in s[key]])

    def slope(prefix: str, scale: float) -> float:
        rise = mean_of(f"{prefix}_b", scale) - mean_of(f"{prefix}_a", scale)
        return max(0.0, rise / (LARGE_B - LARGE_A))

    # a round trip is two one-way messages; an exchange is one step
    alpha, beta = mean_of("ping_pong_tiny", 0.5), slope("ping_pong", 0.5)
    alpha_x, beta_x = mean_of("exchange_tiny"), slope("exchange", 1.0)
    gamma = trimmed_mean([t for s in per_rank for t in s["add"]]) / LARGE_B
    native = [trimmed_mean(slowest_rank([s[key] for s in per_rank]))
              for key in ("native_small", "native_large")]
    native_alpha, native_beta = native_fit(p, (NATIVE_SMALL, native[0]),
                                           (NATIVE_LARGE, native[1]), gamma)
    return LinkCosts(alpha=alpha, beta=beta, gamma=gamma, alpha_exchange=alpha_x,
                     beta_exchange=beta_x, native_alpha=native_alpha, native_beta=native_beta,
                     chunk_bytes=chunk_bytes,
                     source=f"disttrain bench comm --calibrate on {p} ranks")


def _describe(p: int, index: int) -> str:
    return f"calibration on {p} ranks"


def calibrate(transport: str, world_sizes: tuple[int, ...], timeout_s: float,
              reps: int = 20) -> tuple[LinkCosts, str]:
    """Measure at each world size, store with save_costs; returns (costs, path written).
    The top-level costs are those of the smallest world size."""
    entries: dict[int, LinkCosts] = {}
    for p in sorted(set(world_sizes)):
        with RankGroup(p, measure, (reps,), transport=transport, timeout_s=timeout_s,
                       describe=functools.partial(_describe, p)) as group:
            reports = list(group.reports())
        tables = fit_tables(table_plan(), reports[1:])
        entries[p] = replace(fit(p, reports[0], LinkCosts().chunk_bytes), measured=tables)
    # tables belong to their world size: the top-level costs (used for uncalibrated world
    # sizes) keep only the constants
    costs = with_world_sizes(replace(entries[min(entries)], measured=()), entries)
    return costs, str(save_costs(transport, costs))
