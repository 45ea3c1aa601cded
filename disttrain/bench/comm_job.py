"""What each rank runs for ``disttrain bench comm``: time every (op, size, algorithm) case.

For each case: one checked call (it also warms up), ``warmup`` untimed calls, then the timed
block. Every timed iteration is ``reset`` (untimed) → barrier (:func:`start_barrier`) → timed
call → check, so every iteration starts together and every result is verified (nccl-tests
``-c``). The rank reports
its own times; the parent takes the slowest rank per iteration.

Iteration count: ``iters``, or fewer when ``budget_s`` > 0 and ``iters`` calls would take
longer than that (judged from the slowest rank's warm-up time, agreed by an all_reduce, so
every rank runs the same number of calls).
"""

from __future__ import annotations

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


def measure(comm: Communicator, case: cases.Case, algorithm: str,
            timing: Timing, shared: bool = False) -> dict[str, Any]:
    """One case on this rank: its times, bytes sent, correctness and chosen algorithm; or
    ``{"skipped": why}`` when the algorithm cannot run here (e.g. ``native`` without a
    torch.distributed group): algorithms refuse with a ValueError before any byte moves."""
    barrier = start_barrier(comm)
    try:
        warm = [_timed_call(comm, case, algorithm, barrier)]
    except ValueError as exc:
        return {"skipped": str(exc)}
    correct = case.check()
    warm += [_timed_call(comm, case, algorithm, barrier) for _ in range(timing.warmup)]
    iters = _agree_iters(comm, warm, timing)
    sent_before = comm.stats.snapshot().get(case.op, {}).get("bytes_sent", 0)
    times = []
    for _ in range(iters):
        times.append(_timed_call(comm, case, algorithm, barrier))
        correct = case.check() and correct
    sent = comm.stats.snapshot().get(case.op, {}).get("bytes_sent", 0) - sent_before
    chosen = comm.flight_recorder.dump()[-1]["algorithm"]
    return {"times": times, "bytes_sent": sent / iters, "correct": correct, "chosen": chosen,
            "nbytes": case.nbytes, "transport": comm.transport.name, "shared_buffers": shared}


def run_plan(comm: Communicator, emit: Callable[[Any], None],
             plan: list[tuple[str, str, int]], timing: Timing, shared: bool = False) -> None:
    """The job: ``plan`` is [(op, algorithm, nbytes)], grouped by (op, nbytes) so each case's
    buffers and references are built once and its algorithms are timed back to back.
    ``shared``: in-place cases use ``Communicator.shared_zeros`` buffers."""
    built: tuple[str, int] | None = None
    case: cases.Case | None = None
    for op, algorithm, nbytes in plan:
        if built != (op, nbytes):
            case, built = None, None  # free the previous buffers first
            case, built = cases.build(comm, op, nbytes, shared), (op, nbytes)
        assert case is not None
        emit(measure(comm, case, algorithm, timing, shared))
