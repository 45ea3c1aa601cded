"""What each rank runs for ``disttrain bench comm``: time every (op, size, algorithm) case.

For each case: one checked call (it also warms up), ``warmup`` untimed calls, then the timed
calls: one block per algorithm, or (``interleave``) a size's algorithms call by call, in a
fresh shuffled order every round (:func:`round_order`). Every timed iteration is ``reset``
(untimed) → barrier (:func:`start_barrier`) → timed call → check, so every iteration starts
together and every result is verified (nccl-tests ``-c``). The rank reports its own times;
the parent takes the slowest rank per iteration.

Iteration count: ``iters``, or fewer when ``budget_s`` > 0 and ``iters`` calls would take
longer than that (judged from the slowest rank's warm-up time, agreed by an all_reduce, so
every rank runs the same number of calls).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.bench import cases
from disttrain.comm import Communicator

MIN_ITERS = 3


@dataclass(frozen=True)
class Timing:
    """How long to measure each case (validated by the command's config)."""

    iters: int
    warmup: int
    budget_s: float


def start_barrier(comm: Communicator) -> str | None:
    """The barrier that lines ranks up before each timed call: the one that releases all
    ranks closest together, because a rank that leaves it early times its wait for the last
    one as part of the call. That is the shared-memory barrier where the transport has one
    (ranks leave it within microseconds of the last arrival), else torch.distributed's own
    (Gloo's exit skew is a message latency, tens of µs to ms). Neither depends on the cost
    model, so rows stay comparable across calibrations; every row of one run (``native``
    included) starts from the same barrier."""
    if comm.transport.name == "shm":
        return "shm"
    return "native" if comm.transport.native_group is not None else None


def _timed_call(comm: Communicator, case: cases.Case, algorithm: str,
                barrier: str | None) -> float:
    case.reset()
    comm.barrier(algorithm=barrier)
    start = time.perf_counter()
    case.run(algorithm)
    return time.perf_counter() - start


def _agree_iters(comm: Communicator, warm: list[float], timing: Timing) -> int:
    if timing.budget_s <= 0:
        return timing.iters
    slowest = torch.tensor([sum(warm) / len(warm)], dtype=torch.float64)
    comm.all_reduce(slowest, op="max")
    fits = int(timing.budget_s / max(float(slowest.item()), 1e-9))
    return max(min(MIN_ITERS, timing.iters), min(timing.iters, fits))


def measure(comm: Communicator, case: cases.Case, algorithms: list[str], timing: Timing,
            shared: bool = False) -> list[dict[str, Any]]:
    """Time ``algorithms`` on one case; one report per algorithm, in the order given: its
    times, bytes sent, correctness and chosen algorithm, or ``{"skipped": why}`` when it
    cannot run here (e.g. ``native`` without a torch.distributed group: algorithms refuse
    with a ValueError before any byte moves, on every rank alike).

    With several algorithms the calls are interleaved, one round of every algorithm after
    another, instead of one block each. On a busy or oversubscribed machine (4 ranks on
    2 cores) two blocks of the *same* code can differ by more than two algorithms do;
    interleaved, every algorithm sees the same moods of the machine, so their ratios
    (``auto`` against the best) mean something. One algorithm is one block."""
    barrier = start_barrier(comm)
    reports: dict[str, dict[str, Any]] = {}
    warm: dict[str, list[float]] = {}
    correct: dict[str, bool] = {}
    for algorithm in algorithms:
        try:
            warm[algorithm] = [_timed_call(comm, case, algorithm, barrier)]
        except ValueError as exc:
            reports[algorithm] = {"skipped": str(exc)}
            continue
        correct[algorithm] = case.check()
    live = list(warm)
    if live:
        for _ in range(timing.warmup):
            for algorithm in live:
                warm[algorithm].append(_timed_call(comm, case, algorithm, barrier))
        rounds = [sum(warm[a][k] for a in live) for k in range(timing.warmup + 1)]
        iters = _agree_iters(comm, rounds, Timing(timing.iters, timing.warmup,
                                                  timing.budget_s * len(live)))
        times: dict[str, list[float]] = {a: [] for a in live}
        sent = dict.fromkeys(live, 0)
        chosen: dict[str, str] = {}
        for i in range(iters):
            for algorithm in round_order(live, i):
                before = _bytes_sent(comm, case.op)
                times[algorithm].append(_timed_call(comm, case, algorithm, barrier))
                sent[algorithm] += _bytes_sent(comm, case.op) - before
                correct[algorithm] = case.check() and correct[algorithm]
                if algorithm not in chosen:
                    chosen[algorithm] = comm.flight_recorder.dump()[-1]["algorithm"]
        for a in live:
            reports[a] = {"times": times[a], "bytes_sent": sent[a] / iters,
                          "correct": correct[a], "chosen": chosen[a], "nbytes": case.nbytes,
                          "transport": comm.transport.name, "shared_buffers": shared,
                          "interleaved": len(live) > 1}
    return [reports[a] for a in algorithms]


def round_order(algorithms: list[str], i: int) -> list[str]:
    """The order of interleaved round ``i``: a shuffle seeded by ``i``, so every rank calls
    the same algorithm at the same time. A rotation (a, b, c, then b, c, a) would keep each
    algorithm behind the same predecessor in almost every round, and a call can pay for the
    one before it: measured on 4 ranks over Gloo, ``auto`` (always right after ``native``)
    ran tree 2.7× slower than tree's own calls (always right after ``ring``) at 4 KiB."""
    order = list(algorithms)
    random.Random(i).shuffle(order)
    return order


def _bytes_sent(comm: Communicator, op: str) -> int:
    return int(comm.stats.snapshot().get(op, {}).get("bytes_sent", 0))


def run_plan(comm: Communicator, emit: Callable[[Any], None],
             plan: list[tuple[str, str, int]], timing: Timing, shared: bool = False,
             interleave: bool = False) -> None:
    """The job: ``plan`` is [(op, algorithm, nbytes)], grouped by (op, nbytes) so each case's
    buffers and references are built once and its algorithms are timed back to back (one
    block each), or call by call with ``interleave`` (:func:`measure`).
    ``shared``: in-place cases use ``Communicator.shared_zeros`` buffers."""
    comm.expect_workload("collectives")  # Gloo's native rows alike: the same process
    groups: list[tuple[str, int, list[str]]] = []
    for op, algorithm, nbytes in plan:
        if groups and groups[-1][:2] == (op, nbytes):
            groups[-1][2].append(algorithm)
        else:
            groups.append((op, nbytes, [algorithm]))
    for op, nbytes, algorithms in groups:
        case = cases.build(comm, op, nbytes, shared)
        batches = [algorithms] if interleave else [[a] for a in algorithms]
        for batch in batches:
            for report in measure(comm, case, batch, timing, shared):
                emit(report)
        del case  # free the buffers before the next case's
