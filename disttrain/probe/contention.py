"""How much slower a rank computes when every core of this machine computes at once.

Ranks of ``disttrain bench`` are processes, one thread each. Alone, a process has a core,
the shared caches and the memory bandwidth to itself; when every core computes, each
process gets its core but shares the rest (and on a virtual machine its vCPUs may be
hyperthreads of one physical core). :func:`concurrent_slowdown` runs the same work in
``processes`` forked processes at once and divides their time by the time alone; the
event engine applies it while more than one core computes
(:class:`~disttrain.simulate.events.Simulation`'s ``slowdown``). It concerns this machine
only: on a cluster every rank has its own device.

:func:`collective_in_step` measures the other thing sharing does: what a collective costs
when issued right after every rank computed, as in a training step (threads and processes
that must be woken and scheduled again, the kernel's placement of the ranks). Forked ranks
time it on the transport the profile is for (``torch``: Gloo point-to-point; ``shm``:
shared memory); the profile charges what it takes beyond the calibrated price of the same
collective as the wake-up (:func:`~disttrain.probe.wrappers.measure_overheads`). On this
project's 2-vCPU test host a 2-rank Gloo all-reduce of LeNet's gradients costs 1 ms or 3-7
ms in a step, 85 % of the time the latter, after a barrier as well as after compute
(docs/simulate.md, "Why the model is built this way").
Which price it mostly pays depends on the collective: a reduce-scatter issued
asynchronously, as ZeRO-2 and ZeRO-3 reduce gradients, mostly pays the fast one, so it is
probed apart (``op``). A synchronous reduce-scatter (ZeRO-1's) costs what the synchronous
all-reduce does (4.4-4.6 against 4.6-4.7 ms on Gloo, 0.6 against 0.7 ms on shared memory,
in a variant of this probe), so it is charged the all-reduce's wake-up.

:func:`unit_ops_in_step` measures ZeRO-3's pattern apart: many small collectives, each
issued asynchronously to the progress thread while the rank computes and waited for
before the next, which on this host cost more each than the calibration's back-to-back
calls and the one-rank call overhead together (docs/simulate.md, "Why the model is built this way").
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from disttrain.bench import ranks as bench_ranks
from disttrain.bench.ranks import rank_comm
from disttrain.launch.ranks import LocalRanks
from disttrain.probe.timing import median_time

log = logging.getLogger(__name__)
TIMEOUT_S = 60.0


def _slowdown_child(rank: int, ranks: int, store: str, report: Callable[[Any], None],
                    work: Callable[[], object], barrier: Any, repeats: int) -> None:
    torch.set_num_threads(1)
    try:
        barrier.wait(TIMEOUT_S)
        report(median_time(work, repeats))
    except Exception as exc:  # reported to the parent, which falls back to 1
        report(f"{type(exc).__name__}: {exc}")


def concurrent_slowdown(work: Callable[[], object], processes: int,
                        repeats: int = 40) -> float:
    """Time of ``work`` in each of ``processes`` processes at once (their mean median)
    over its time alone, at least 1. Falls back to 1 (logged) if the processes fail."""
    if processes < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return 1.0
    alone = median_time(work, repeats)
    barrier = multiprocessing.get_context("fork").Barrier(processes)  # inherited by fork
    try:
        times = forked_ranks(_slowdown_child, processes, work, barrier, repeats)
    except Exception as exc:
        log.warning("could not measure the concurrent slowdown (%s); assuming none", exc)
        return 1.0
    return max(1.0, statistics.mean(times) / alone) if alone > 0 else 1.0


def forked_ranks(child: Callable[..., None], ranks: int, *args: Any,
                 bind: bool = False) -> list[Any]:
    """Run ``child(rank, ranks, store_path, report, *args)`` in ``ranks`` forked
    processes (:class:`~disttrain.launch.ranks.LocalRanks`; the probes' work and modules
    are closures: not picklable) and return the one value each ``report``-ed, in arrival
    order. ``bind``: each rank pinned to the core ``disttrain bench --bind-cores`` pins a
    rank of ``ranks`` to (:func:`~disttrain.bench.ranks.bind_plan`; unbound where it has
    no plan). Raises if fork is unavailable or a rank reports an error (a str), raises,
    dies or is silent for TIMEOUT_S; always reaps the ranks."""
    if "fork" not in multiprocessing.get_all_start_methods():
        raise RuntimeError("this platform cannot fork processes")
    plan = bench_ranks.bind_plan(ranks) if bind else None
    cores: list[int | None] = list(plan) if plan else [None] * ranks
    group = LocalRanks(_pinned, [(cores[r], child, *args) for r in range(ranks)],
                       start="fork", name="disttrain-probe-r", prefix="disttrain-probe-")
    try:
        return _gather(group)
    finally:
        group.close(grace_s=10.0)  # a rank that reported closes its communicator first


def _gather(group: LocalRanks) -> list[Any]:
    """One value from each rank of ``group``, in arrival order, each within TIMEOUT_S of
    the one before; a str is a rank's error, raised."""
    values: list[Any] = []
    heard: set[int] = set()
    deadline = time.monotonic() + TIMEOUT_S
    while len(heard) < group.world_size:
        if time.monotonic() > deadline:
            silent = sorted(set(range(group.world_size)) - heard)
            raise RuntimeError(f"probe ranks {silent} sent nothing for {TIMEOUT_S:g}s")
        for event in group.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if event.rank in heard:
                continue
            if event.kind == "report" and isinstance(event.value, str):
                raise RuntimeError(event.value)
            if event.kind == "report":
                heard.add(event.rank)
                values.append(event.value)
                deadline = time.monotonic() + TIMEOUT_S
            elif event.kind == "error":
                raise RuntimeError(f"probe rank {event.rank} raised: "
                                   f"{event.value.strip().splitlines()[-1]}")
            else:
                raise RuntimeError(f"probe rank {event.rank} ended without a value (exit "
                                   f"code {group.exit_code(event.rank, 1.0)})")
    return values


def _pinned(rank: int, ranks: int, store: str, report: Callable[[Any], None],
            core: int | None, child: Callable[..., None], *args: Any) -> None:
    if core is not None:  # first, so every thread the rank starts (Gloo's too) inherits it
        try:
            os.sched_setaffinity(0, {core})
        except OSError as exc:  # reported at once, not after the parent's TIMEOUT_S
            report(f"rank {rank} could not be bound to core {core}: {exc}")
            return
    child(rank, ranks, store, report, *args)


def _collective_child(rank: int, ranks: int, store: str, report: Callable[[Any], None],
                      work: Callable[[], object], nbytes: int, repeats: int,
                      transport: str, op: str) -> None:
    try:
        with rank_comm(rank, ranks, store, transport, TIMEOUT_S) as comm:
            comm.expect_workload("collectives")  # as the DDP and ZeRO runs it stands for
            numel = max(1, nbytes // 4)
            if op == "reduce_scatter":  # equal shards
                numel = max(ranks, numel // ranks * ranks)
            x, shard = torch.zeros(numel), torch.zeros(max(1, numel // ranks))
            times = []
            for _ in range(repeats + 2):
                comm.barrier()
                work()  # every rank computes, as in a training step
                start = time.perf_counter()
                if op == "all_reduce":  # synchronous, as DDP's last bucket
                    comm.all_reduce(x, algorithm="ring")
                else:  # on the progress thread, then waited for, as ZeRO-2/3's gradients
                    pending = comm.reduce_scatter(shard, x, algorithm="ring", async_op=True)
                    assert pending is not None
                    pending.wait()
                times.append(time.perf_counter() - start)
        report(statistics.median(times[2:]))
    except Exception as exc:  # reported to the parent, which falls back to 0
        report(f"{type(exc).__name__}: {exc}")


def collective_in_step(work: Callable[[], object], nbytes: int, repeats: int = 15,
                       transport: str = "torch", ranks: int = 2,
                       op: str = "all_reduce", bind: bool = False) -> float:
    """Seconds of a ``ranks``-rank ring ``op`` (``all_reduce``, called synchronously as
    DDP's last bucket, or ``reduce_scatter``, issued asynchronously and waited for as
    ZeRO-2 and ZeRO-3 reduce gradients) of ``nbytes`` on ``transport``, issued right after
    every rank ran ``work`` (as in a training step): the median over ranks of each rank's
    median over ``repeats`` calls; ``bind`` as :func:`forked_ranks`. 0 (logged) if the
    ranks fail."""
    if op not in ("all_reduce", "reduce_scatter"):
        raise ValueError(f"op must be 'all_reduce' or 'reduce_scatter', got {op!r}")
    try:
        times = forked_ranks(_collective_child, ranks, work, nbytes, repeats, transport, op,
                             bind=bind)
    except Exception as exc:
        log.warning("could not measure the in-step %s wake-up (%s); assuming none", op, exc)
        return 0.0
    return float(statistics.median(times))


def compute_slice(seconds: float) -> Callable[[], None]:
    """Work of about ``seconds`` on one core: a small matrix product repeated (timed here,
    on the calling thread)."""
    a = torch.randn(64, 64)
    one = median_time(lambda: a @ a)
    reps = max(1, round(seconds / one)) if one > 0 else 1

    def work() -> None:
        for _ in range(reps):
            a @ a

    return work


def _units_child(rank: int, ranks: int, store: str, report: Callable[[Any], None],
                 work: Callable[[], object], sizes: list[int], repeats: int,
                 transport: str) -> None:
    try:
        with rank_comm(rank, ranks, store, transport, TIMEOUT_S) as comm:
            comm.expect_workload("collectives")  # as the ZeRO-3 runs it stands for
            full = [torch.zeros(max(ranks, n // 4 // ranks * ranks)) for n in sizes]
            shards = [torch.zeros(f.numel() // ranks) for f in full]
            with_ops: list[float] = []
            without: list[float] = []
            for i in range(2 * repeats + 4):
                comm.barrier()
                ops = i % 2 == 1  # alternate: the machine's drift hits both
                start = time.perf_counter()
                for backward in (False, True):  # the unit order does not matter here
                    scatters: list[Any] = []
                    for f, shard in zip(full, shards, strict=True):
                        pending = comm.all_gather(f, shard, algorithm="ring",
                                                  async_op=True) if ops else None
                        work()
                        if pending is not None:
                            pending.wait()
                            if backward:
                                scatters.append(comm.reduce_scatter(
                                    shard, f, algorithm="ring", async_op=True))
                    for w in scatters:
                        w.wait()
                (with_ops if ops else without).append(time.perf_counter() - start)
        report(statistics.median(with_ops[2:]) - statistics.median(without[2:]))
    except Exception as exc:  # reported to the parent, which falls back to 0
        report(f"{type(exc).__name__}: {exc}")


def unit_ops_in_step(work: Callable[[], object], sizes: list[int], repeats: int = 9,
                     transport: str = "torch", ranks: int = 2, bind: bool = False) -> float:
    """Seconds that ZeRO-3's collectives add to a step of ``ranks`` ranks on
    ``transport``: per unit of ``sizes`` (its parameter bytes) a ring all-gather issued
    asynchronously before ``work`` (the unit's computation) and waited for after it, in
    a forward and a backward pass, and in the backward a ring reduce-scatter issued
    asynchronously after it, all waited for at the end; the step with them less the same
    step without, in alternating iterations (the median of each over ``repeats``), the
    median over ranks; ``bind`` as :func:`forked_ranks`. 0 (logged) if the ranks fail."""
    if not sizes:
        return 0.0
    try:
        added = forked_ranks(_units_child, ranks, work, list(sizes), repeats, transport,
                             bind=bind)
    except Exception as exc:
        log.warning("could not measure ZeRO-3's collectives in a step (%s); assuming none",
                    exc)
        return 0.0
    return max(0.0, float(statistics.median(added)))
