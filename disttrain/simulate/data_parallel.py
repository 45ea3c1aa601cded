"""DDP and ZeRO 1/2/3 as event simulations of one representative rank.

Every data-parallel rank runs the same layers on the same number of samples and joins the
same collectives, so one rank's timeline *is* the step (the collective's duration already
accounts for all p ranks, see :mod:`~disttrain.simulate.collectives`). Stragglers enter as
the expected slowest rank's speed: a synchronous collective cannot finish before the
slowest rank has produced its part. Per rank::

    compute  F0 F1 … F(L−1) B(L−1) … B1 B0 ─────────── opt
    link                    ar(bucket 0) ar(bucket 1) …        (DDP: fifo, like the
                                                                progress thread)

* **DDP**: buckets planned by :func:`disttrain.parallel.ddp.buckets.plan_buckets` (reverse layer
  order, 1 MiB first bucket, 25 MiB after), each all-reduced as soon as its last layer's
  backward ends, overlapping the rest of backward.
* **ZeRO-1**: backward, then reduce-scatter of all gradients, the optimizer on 1/N, and an
  all-gather of the parameters (nothing overlaps: disttrain's stage 1 reduces in ``step``).
* **ZeRO-2**: reduce-scatter per bucket during backward (as DDP), then optimizer and
  all-gather.
* **ZeRO-3**: each layer's parameters all-gathered before its forward and again before its
  backward, one layer ahead (prefetch), and its gradients reduce-scattered after its
  backward; the optimizer runs on 1/N.

The profile's measured :class:`~disttrain.simulate.overheads.Overheads` are tasks too: the
loop's own work before the first forward, DDP's hooks in each layer's backward, one
collective call before every collective on the link, ZeRO's own work (stages 1, 2: after
the all-gather; stage 3: spread over every layer), and the optimizer at its measured cost.
On this machine ZeRO-3's collectives pay the probe of its own pattern (``zero3_op_*``:
small collectives issued asynchronously between the units' computations) instead of the
call and the wake-up.
On this machine the representative's compute resource carries a load of p ranks, so the
engine slows it when p exceeds the cores.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

from disttrain.parallel.ddp.buckets import MIB, plan_buckets
from disttrain.simulate import memory
from disttrain.simulate.base import Case, StepResult, not_applicable
from disttrain.simulate.collectives import Group
from disttrain.simulate.events import Simulation


def _forward_backward(sim: Simulation, case: Case, batch: float, factor: float,
                      fwd_deps: dict[int, tuple[int, ...]] | None = None,
                      bwd_deps: dict[int, tuple[int, ...]] | None = None,
                      extra: tuple[list[float], list[float]] | None = None
                      ) -> tuple[list[int], list[int]]:
    """The loop's own work, then forward and backward tasks of every layer on "compute"
    (one representative standing for every rank: its load on shared cores); ``extra``
    adds host seconds per layer (forward, backward). Returns (fwd, bwd) ids, bwd indexed
    by layer."""
    case.compute(sim, "compute", case.workers)
    case.link(sim)
    add_f, add_b = extra or ([0.0] * case.layers, [0.0] * case.layers)
    if case.overheads.step_s:
        sim.add("loop", "compute", case.overheads.step_s, (), "overhead")
    fwd, bwd = [], [0] * case.layers
    for i in range(case.layers):
        fwd.append(sim.add(f"F{i}", "compute", case.forward(i, batch, factor) + add_f[i],
                           (fwd_deps or {}).get(i, ()), "forward"))
    for i in reversed(range(case.layers)):
        bwd[i] = sim.add(f"B{i}", "compute", case.backward(i, batch, factor) + add_b[i],
                         (bwd_deps or {}).get(i, ()), "backward")
    return fwd, bwd


def _buckets(case: Case) -> list[list[int]]:
    sizes = [max(1, lay.params * case.workload.element_bytes) for lay in case.profile.layers]
    return plan_buckets(sizes, [0] * len(sizes), int(case.workload.first_bucket_mb * MIB),
                        int(case.workload.bucket_mb * MIB))


def issue_collective(sim: Simulation, case: Case, name: str, seconds: float, deps: tuple[int, ...],
           probe: str = "all_reduce", in_step: float | None = None) -> int:
    """A collective on "link": the call's software overhead (measured on one rank; on this
    machine plus the wake-up of a collective issued after compute, in proportion to how
    long the link sat idle before it, in full after the probe's own compute: one queued
    right behind another, like ZeRO-3's prefetched gathers, wakes nothing), then its α-β-γ
    time for every rank. ``probe`` names whose wake-up it pays: ``"reduce_scatter"``'s,
    probed issued asynchronously and waited for (ZeRO-2/3's gradients), or, for any other
    name, the all-reduce's, probed as a synchronous call (DDP's last bucket, ZeRO-1's
    calls, every all-gather). ``in_step``, when measured, replaces both: what one such
    collective costs in a step beyond its α-β-γ time (ZeRO-3's pattern, probed)."""
    call, wake = case.overheads.collective_call_s, case.wakeup_of(probe)
    if in_step is not None:
        call, wake = in_step, 0.0
    if call or wake:
        deps = (sim.add(f"call:{name}", "link", call, deps, "overhead", cold_s=wake,
                        cold_after_s=case.overheads.collective_wakeup_after_s),)
    return sim.add(name, "link", seconds, deps, "comm")


def _bucketed(sim: Simulation, case: Case, op: str, bwd: list[int],
              size: int | None = None) -> tuple[list[int], float, set[str]]:
    """One ``op`` per bucket on "link" over ``size`` ranks (default: all), each after its
    last layer's backward."""
    group = case.group(size or case.workers)
    tasks: list[int] = []
    sent, algorithms = 0.0, set[str]()
    for bucket in _buckets(case):
        seconds, nbytes, algorithm = case.collective(op, group, case.grad_bytes(bucket))
        ready = bwd[min(bucket)]  # reverse order: the lowest layer's backward ends last
        tasks.append(issue_collective(sim, case, f"{op}{len(tasks)}", seconds, (ready,), op))
        sent += nbytes
        algorithms.add(algorithm)
    return tasks, sent, algorithms


def _result(case: Case, name: str, sim: Simulation, states: float, extra_memory: float,
            sent: float, algorithms: set[str], factor: float, optimizer_s: float) -> StepResult:
    step = sim.run()
    compute_s = sim.busy("compute")  # wall time, stretched where ranks share the cores
    batch = case.global_batch / case.workers
    saved = sum(lay.saved_bytes_per_sample for lay in case.profile.layers)
    mem = states + memory.activations(saved, batch, case.workload.element_bytes) + extra_memory
    exposed = max(0.0, step - compute_s)
    notes = [f"exposed comm {exposed / step:.0%}" if step > 0 else "no comm"]
    if case.cluster.shared_cores and case.workers > case.cluster.shared_cores:
        notes.append(f"{case.workers} ranks share {case.cluster.shared_cores} cores")
    if factor > 1:
        notes.append(f"slowest of {case.workers} workers ×{factor:.2f}")
    return StepResult(name, case.workers, case.global_batch, step, case.ideal_s(), mem, sent,
                      case.cluster.device_memory, tuple(notes),
                      {"exposed_comm_s": exposed, "compute_s": compute_s,
                       "optimizer_s": optimizer_s,
                       "algorithm": ",".join(sorted(algorithms - {"none"})) or "none",
                       "events": len(sim)})


def _states(case: Case, stage: int) -> float:
    wl = case.workload
    return memory.model_states(stage, case.profile.params, _shard(case)[0], wl.element_bytes,
                               wl.k_bytes).total


def _shard(case: Case) -> tuple[int, Group | None]:
    """(ranks a ZeRO shard group spans, the replicate group or None): hybrid sharding
    (``Workload.dp_shard``: S consecutive ranks, a node's, replicated across the R groups,
    whose members sit S apart), else every rank in one shard group."""
    s = case.workload.dp_shard
    if s is None or s >= case.workers:
        return case.workers, None
    return s, case.group(case.workers // s, stride=s)


def _replicate(sim: Simulation, case: Case, after: int, shard_bytes: float,
               tag: str) -> tuple[int, float, set[str]]:
    """Hybrid sharding: the reduced gradient shard all-reduced across the replicas."""
    _, group = _shard(case)
    if group is None:
        return after, 0.0, set()
    seconds, sent, algorithm = case.collective("all_reduce", group, shard_bytes)
    return issue_collective(sim, case, tag, seconds, (after,)), sent, {algorithm}


def simulate_data_parallel(case: Case, name: str, zero: int) -> StepResult:
    """The data-parallel step of preset ``name``: DDP (``zero`` 0) or ZeRO stage 1-3."""
    if case.global_batch < case.workers:  # a sample is the least a replica can take
        return not_applicable(case, name, f"global batch {case.global_batch} leaves some of "
                                          f"the {case.workers} data-parallel ranks without a "
                                          f"sample (cp splits each sample's sequence)")
    if zero == 0:
        return simulate_ddp(case, name)
    s = case.workload.dp_shard
    if s is not None and s < case.workers and case.workers % s:
        return not_applicable(case, name, f"--dp-shard {s} does not divide {case.workers} "
                                          f"ranks into shard groups")
    row = simulate_zero3(case, name) if zero == 3 else simulate_zero12(case, zero, name)
    size, replicas = _shard(case)
    if replicas is None or row.error is not None:
        return row
    return replace(row, notes=(f"hybrid: shard {size} × replicate {case.workers // size}",
                               *row.notes))


def simulate_ddp(case: Case, name: str = "ddp") -> StepResult:
    factor = case.workload.speeds.slowest(case.workers)
    batch = case.global_batch / case.workers
    sim = case.simulation()
    hooks = [lay.tensors * case.overheads.hook_s_per_tensor for lay in case.profile.layers]
    _, bwd = _forward_backward(sim, case, batch, factor, extra=([0.0] * case.layers, hooks))
    reduces, sent, algorithms = _bucketed(sim, case, "all_reduce", bwd)
    opt_s = case.optimizer(case.profile.params, case.profile.tensors)
    sim.add("opt", "compute", opt_s, tuple(reduces), "optimizer")
    return _result(case, name, sim, _states(case, 0), 0.0, sent, algorithms, factor, opt_s)


def simulate_zero12(case: Case, stage: int, name: str | None = None) -> StepResult:
    factor = case.workload.speeds.slowest(case.workers)
    batch = case.global_batch / case.workers
    size, _ = _shard(case)
    group = case.group(size)
    sim = case.simulation()
    _, bwd = _forward_backward(sim, case, batch, factor)
    grads = case.grad_bytes()
    if stage == 2:
        reduces, sent, algorithms = _bucketed(sim, case, "reduce_scatter", bwd, size)
    else:
        seconds, sent, algorithm = case.collective("reduce_scatter", group, grads)
        # called synchronously right after backward, as the all-reduce probe is, so it pays
        # that probe's wake-up: on a shared host a synchronous call pays the slow price more
        # often (charged the asynchronous reduce-scatter's wake-up, ZeRO-1 on 2 Gloo ranks
        # read 0.61-0.86 of its runs; charged this one, 0.91-1.17)
        reduces = [issue_collective(sim, case, "rs", seconds, (bwd[0],))]
        algorithms = {algorithm}
    last, across, more = _replicate(sim, case, reduces[-1], grads / size, "ar-shard")
    reduces, sent, algorithms = [*reduces, last], sent + across, algorithms | more
    opt_s = case.optimizer(case.profile.params / size)
    opt = sim.add("opt", "compute", opt_s, tuple(reduces), "optimizer")
    seconds, ag_bytes, algorithm = case.collective("all_gather", group, grads)
    ag = issue_collective(sim, case, "ag", seconds, (opt,))
    work = case.overheads.zero_s.get(stage, 0.0)  # flatten, shard, copy back (measured)
    if work:
        sim.add("zero-work", "compute", work, (ag,), "overhead")
    return _result(case, name or f"zero{stage}", sim, _states(case, stage), 0.0,
                   sent + ag_bytes, algorithms | {algorithm}, factor, opt_s)


def simulate_zero3(case: Case, name: str | None = None) -> StepResult:
    """Per unit (a layer with parameters; the wrapper has none for the others): gathered
    before forward and again before backward, one unit ahead, reduce-scattered after."""
    factor = case.workload.speeds.slowest(case.workers)
    size, _ = _shard(case)
    batch, group, n = case.global_batch / case.workers, case.group(size), case.layers
    sim = case.simulation()
    case.compute(sim, "compute", case.workers)
    case.link(sim)
    sent, algorithms = 0.0, set()
    units = [i for i in range(n) if case.profile.layers[i].params > 0]
    own = case.overheads.zero_s.get(3, 0.0) / (2 * max(1, len(units)))  # gather, free
    # on this machine each collective in ZeRO-3's pattern costs what the probe measured
    in_step = case.overheads.unit_op(case.workers) if case.cluster.shared_cores else None

    def collective(name: str, op: str, layer: int, deps: tuple[int, ...]) -> int:
        nonlocal sent
        seconds, nbytes, algorithm = case.collective(op, group, case.grad_bytes([layer]))
        sent += nbytes
        algorithms.add(algorithm)
        return issue_collective(sim, case, name, seconds, deps, op, in_step)

    if case.overheads.step_s:
        sim.add("loop", "compute", case.overheads.step_s, (), "overhead")
    ahead = dict(pairwise(units))
    gathers = {units[0]: collective(f"agF{units[0]}", "all_gather", units[0], ())} \
        if units else {}
    fwd: list[int] = []
    for i in range(n):
        if i in ahead:  # prefetch: issued when unit i starts, i.e. after F(i−1) and ag(i)
            gathers[ahead[i]] = collective(f"agF{ahead[i]}", "all_gather", ahead[i],
                                           (gathers[i], *fwd[-1:]))
        fwd.append(sim.add(f"F{i}", "compute", case.forward(i, batch, factor) +
                           (own if i in gathers else 0.0), _only(gathers, i), "forward"))
    behind = {later: earlier for earlier, later in pairwise(units)}
    back = {units[-1]: collective(f"agB{units[-1]}", "all_gather", units[-1], (fwd[-1],))} \
        if units else {}
    bwd: dict[int, int] = {}
    for i in reversed(range(n)):
        if i in behind:
            back[behind[i]] = collective(f"agB{behind[i]}", "all_gather", behind[i],
                                         (back[i], *([bwd[i + 1]] if i + 1 < n else [])))
        bwd[i] = sim.add(f"B{i}", "compute", case.backward(i, batch, factor) +
                         (own if i in back else 0.0), _only(back, i), "backward")
        if i in back:
            rs = collective(f"rs{i}", "reduce_scatter", i, (bwd[i],))
            _, across, more = _replicate(sim, case, rs, case.grad_bytes([i]) / size, f"ar{i}")
            sent, algorithms = sent + across, algorithms | more
    opt_s = case.optimizer(case.profile.params / size)
    sim.add("opt", "compute", opt_s, (len(sim) - 1,), "optimizer")
    largest = sorted((lay.params for lay in case.profile.layers), reverse=True)[:2]
    gathered = sum(largest) * case.workload.element_bytes
    return _result(case, name or "zero3", sim, _states(case, 3), gathered, sent,
                   algorithms, factor, opt_s)


def _only(tasks: dict[int, int], layer: int) -> tuple[int, ...]:
    return (tasks[layer],) if layer in tasks else ()
