"""DDP and ZeRO 1/2/3 as event simulations of one representative rank.

Every data-parallel rank runs the same layers on the same number of samples and joins the
same collectives, so one rank's timeline *is* the step (the collective's duration already
accounts for all p ranks, see :mod:`~disttrain.simulate.collectives`). Stragglers enter as
the expected slowest rank's speed: a synchronous collective cannot finish before the
slowest rank has produced its part. Per rank::

    compute  F0 F1 … F(L−1) B(L−1) … B1 B0 ─────────── opt
    link                    ar(bucket 0) ar(bucket 1) …        (DDP: fifo, like the
                                                                progress thread)

* **DDP**: buckets planned by :func:`disttrain.parallel.buckets.plan_buckets` (reverse layer
  order, 1 MiB first bucket, 25 MiB after), each all-reduced as soon as its last layer's
  backward ends, overlapping the rest of backward.
* **ZeRO-1**: backward, then reduce-scatter of all gradients, the optimizer on 1/N, and an
  all-gather of the parameters (nothing overlaps: disttrain's stage 1 reduces in ``step``).
* **ZeRO-2**: reduce-scatter per bucket during backward (as DDP), then optimizer and
  all-gather.
* **ZeRO-3**: each layer's parameters all-gathered before its forward and again before its
  backward, one layer ahead (prefetch), and its gradients reduce-scattered after its
  backward; the optimizer runs on 1/N.
"""

from __future__ import annotations

from disttrain.parallel.buckets import MIB, plan_buckets
from disttrain.simulate import memory
from disttrain.simulate.base import Case, StepResult
from disttrain.simulate.events import Simulation


def _forward_backward(sim: Simulation, case: Case, batch: float, factor: float,
                      fwd_deps: dict[int, tuple[int, ...]] | None = None,
                      bwd_deps: dict[int, tuple[int, ...]] | None = None
                      ) -> tuple[list[int], list[int]]:
    """Forward then backward tasks of every layer on "compute"; returns (fwd, bwd) ids,
    bwd indexed by layer."""
    fwd, bwd = [], [0] * case.layers
    for i in range(case.layers):
        fwd.append(sim.add(f"F{i}", "compute", case.forward(i, batch, factor),
                           (fwd_deps or {}).get(i, ()), "forward"))
    for i in reversed(range(case.layers)):
        bwd[i] = sim.add(f"B{i}", "compute", case.backward(i, batch, factor),
                         (bwd_deps or {}).get(i, ()), "backward")
    return fwd, bwd


def _buckets(case: Case) -> list[list[int]]:
    sizes = [max(1, lay.params * case.workload.element_bytes) for lay in case.profile.layers]
    return plan_buckets(sizes, [0] * len(sizes), int(case.workload.first_bucket_mb * MIB),
                        int(case.workload.bucket_mb * MIB))


def _bucketed(sim: Simulation, case: Case, op: str, bwd: list[int]) -> tuple[list[int], float,
                                                                            set[str]]:
    """One ``op`` per bucket on "link", each after its last layer's backward."""
    group = case.group(case.workers)
    tasks: list[int] = []
    sent, algorithms = 0.0, set[str]()
    for bucket in _buckets(case):
        seconds, nbytes, algorithm = case.collective(op, group, case.grad_bytes(bucket))
        ready = bwd[min(bucket)]  # reverse order: the lowest layer's backward ends last
        tasks.append(sim.add(f"{op}{len(tasks)}", "link", seconds, (ready,), "comm"))
        sent += nbytes
        algorithms.add(algorithm)
    return tasks, sent, algorithms


def _result(case: Case, name: str, sim: Simulation, compute_s: float, states: float,
            extra_memory: float, sent: float, algorithms: set[str], factor: float) -> StepResult:
    step = sim.run()
    batch = case.global_batch / case.workers
    saved = sum(lay.saved_bytes_per_sample for lay in case.profile.layers)
    mem = states + memory.activations(saved, batch, case.workload.element_bytes) + extra_memory
    exposed = max(0.0, step - compute_s)
    notes = [f"exposed comm {exposed / step:.0%}" if step > 0 else "no comm"]
    if factor > 1:
        notes.append(f"slowest of {case.workers} workers ×{factor:.2f}")
    return StepResult(name, case.workers, case.global_batch, step, case.ideal_s(), mem, sent,
                      case.cluster.device_memory, tuple(notes),
                      {"exposed_comm_s": exposed, "compute_s": compute_s,
                       "algorithm": ",".join(sorted(algorithms - {"none"})) or "none",
                       "events": len(sim)})


def _states(case: Case, strategy: str) -> float:
    wl = case.workload
    return memory.model_states(strategy, case.profile.params, case.workers, wl.element_bytes,
                               wl.k_bytes).total


def simulate_ddp(case: Case) -> StepResult:
    factor = case.workload.speeds.slowest(case.workers)
    batch = case.global_batch / case.workers
    sim = Simulation()
    _, bwd = _forward_backward(sim, case, batch, factor)
    reduces, sent, algorithms = _bucketed(sim, case, "all_reduce", bwd)
    opt = case.optimizer(case.profile.params)
    sim.add("opt", "compute", opt, tuple(reduces), "optimizer")
    compute = sum(case.forward(i, batch, factor) + case.backward(i, batch, factor)
                  for i in range(case.layers)) + opt
    return _result(case, "ddp", sim, compute, _states(case, "ddp"), 0.0, sent, algorithms,
                   factor)


def simulate_zero12(case: Case, stage: int) -> StepResult:
    factor = case.workload.speeds.slowest(case.workers)
    batch = case.global_batch / case.workers
    group = case.group(case.workers)
    sim = Simulation()
    _, bwd = _forward_backward(sim, case, batch, factor)
    grads = case.grad_bytes()
    if stage == 2:
        reduces, sent, algorithms = _bucketed(sim, case, "reduce_scatter", bwd)
    else:
        seconds, sent, algorithm = case.collective("reduce_scatter", group, grads)
        reduces, algorithms = [sim.add("rs", "link", seconds, (bwd[0],), "comm")], {algorithm}
    opt_s = case.optimizer(case.profile.params / case.workers)
    opt = sim.add("opt", "compute", opt_s, tuple(reduces), "optimizer")
    seconds, ag_bytes, algorithm = case.collective("all_gather", group, grads)
    sim.add("ag", "link", seconds, (opt,), "comm")
    compute = sum(case.forward(i, batch, factor) + case.backward(i, batch, factor)
                  for i in range(case.layers)) + opt_s
    return _result(case, f"zero{stage}", sim, compute, _states(case, f"zero{stage}"), 0.0,
                   sent + ag_bytes, algorithms | {algorithm}, factor)


def simulate_zero3(case: Case) -> StepResult:
    factor = case.workload.speeds.slowest(case.workers)
    batch, group, n = case.global_batch / case.workers, case.group(case.workers), case.layers
    sim = Simulation()
    sent, algorithms = 0.0, set()

    def collective(name: str, op: str, layer: int, deps: tuple[int, ...]) -> int:
        nonlocal sent
        seconds, nbytes, algorithm = case.collective(op, group, case.grad_bytes([layer]))
        sent += nbytes
        algorithms.add(algorithm)
        return sim.add(name, "link", seconds, deps, "comm")

    gathers = [collective("agF0", "all_gather", 0, ())]
    fwd: list[int] = []
    for i in range(n):
        if i + 1 < n:  # prefetch: issued when layer i starts, i.e. after F(i−1) and ag(i)
            gathers.append(collective(f"agF{i + 1}", "all_gather", i + 1,
                                      (gathers[i], *fwd[-1:])))
        fwd.append(sim.add(f"F{i}", "compute", case.forward(i, batch, factor),
                           (gathers[i],), "forward"))
    back = {n - 1: collective(f"agB{n - 1}", "all_gather", n - 1, (fwd[-1],))}
    bwd: dict[int, int] = {}
    for i in reversed(range(n)):
        if i > 0:
            back[i - 1] = collective(f"agB{i - 1}", "all_gather", i - 1,
                                     (back[i], *([bwd[i + 1]] if i + 1 < n else [])))
        bwd[i] = sim.add(f"B{i}", "compute", case.backward(i, batch, factor), (back[i],),
                         "backward")
        collective(f"rs{i}", "reduce_scatter", i, (bwd[i],))
    opt_s = case.optimizer(case.profile.params / case.workers)
    sim.add("opt", "compute", opt_s, (len(sim) - 1,), "optimizer")
    compute = sum(case.forward(i, batch, factor) + case.backward(i, batch, factor)
                  for i in range(n)) + opt_s
    largest = sorted((lay.params for lay in case.profile.layers), reverse=True)[:2]
    gathered = sum(largest) * case.workload.element_bytes
    return _result(case, "zero3", sim, compute, _states(case, "zero3"), gathered, sent,
                   algorithms, factor)
