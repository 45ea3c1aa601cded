"""Timing on one process: a call's median time, the difference of two alternating calls, and
the single-process costs of :class:`~disttrain.simulate.overheads.Overheads` (the optimizer's
fixed and per-byte cost, its cost per tensor, autograd's cost per ``backward`` call).

Everything here runs on the calling thread; the probes that need several processes are in
:mod:`~disttrain.probe.contention` and beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

REPEATS = 15


def median_time(run: Callable[[], object], repeats: int = REPEATS) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired(base: Callable[[], object], other: Callable[[], object],
           repeats: int = 21, rounds: int = 3) -> float:
    """``other``'s time minus ``base``'s, run alternately (a load that comes and goes on a
    shared machine hits both halves of a pair alike): the median over ``repeats`` pairs,
    the least of ``rounds`` such medians (a burst of load inflates a whole round)."""
    def timed() -> float:
        start = time.perf_counter()
        base()
        return time.perf_counter() - start
    return paired_charge(timed, other, repeats, rounds)


def paired_charge(base: Callable[[], float], other: Callable[[], object],
                  repeats: int = 21, rounds: int = 3) -> float:
    """:func:`paired` where ``base`` returns the seconds it stands for itself (say, the
    sum of the layer times it recorded, not its wall time)."""
    base()
    other()
    medians = []
    for _ in range(rounds):
        diffs = []
        for _ in range(repeats):
            charged = base()
            start = time.perf_counter()
            other()
            diffs.append(time.perf_counter() - start - charged)
        medians.append(statistics.median(diffs))
    return min(medians)


def backward_call() -> float:
    """Seconds of one ``torch.autograd.backward`` on a one-op graph of a 1-element tensor:
    the autograd engine's own cost per call (``Overheads.backward_call_s``)."""
    x = torch.zeros(1, requires_grad=True)
    grad = torch.ones(1)
    return median_time(lambda: torch.autograd.backward(x.mul(2.0), grad), 41)


def optimizer_costs(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                    ) -> tuple[float, float]:
    """(fixed s, s per byte) of the step of ``make([param])`` on one flat fp32 tensor,
    fitted from two sizes (4 KB and 1 MB)."""
    sizes, times = (1 << 10, 1 << 18), []
    for n in sizes:
        p = nn.Parameter(torch.zeros(n))
        p.grad = torch.full((n,), 1e-3)
        opt = make([p])
        times.append(median_time(opt.step))
    per_byte = max(0.0, (times[1] - times[0]) / ((sizes[1] - sizes[0]) * 4))
    return max(0.0, times[0] - sizes[0] * 4 * per_byte), per_byte


def tensor_cost(params: Sequence[nn.Parameter], fixed: float, per_byte: float) -> float:
    """Extra seconds per tensor of an SGD step over ``params`` against one flat tensor."""
    if len(params) < 2:
        return 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(params, lr=0.0, momentum=0.9)
    took = median_time(opt.step)
    nbytes = sum(p.numel() * 4 for p in params)
    for p in params:
        p.grad = None
    return max(0.0, (took - fixed - nbytes * per_byte) / (len(params) - 1))
