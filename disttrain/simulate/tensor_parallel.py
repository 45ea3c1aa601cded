"""Tensor parallelism (``tp``, ``tp-sp``) and tensor parallelism inside a node with data
parallelism across nodes (``3d``), as event simulations of one representative rank.

TP's collectives sit between a layer and the next one: nothing can overlap them (Megatron-LM
hides none of them either without extra machinery), so every one is on the critical path::

    compute  F0 ─ F1 ─────── F2 ─────── … B2 ─────── B1 ─ … opt
    link        ar        ar ar          ar ar        ar      (tp group, serial)

* the collectives of each layer are :func:`~disttrain.parallel.tensor.theory.tp_collectives`
  (4 of b·s·h per block, the embedding's, the head's and the loss's), timed by the cost
  model on the tp group, whose ranks are consecutive: inside one node as long as t ≤ the
  devices per node, across the inter-node link beyond;
* each rank computes 1/t of every layer (the matrix multiplications split evenly; the
  replicated LayerNorms are a rounding error at these sizes) and updates 1/t of the
  parameters;
* ``tp`` puts every worker in one tp group; ``3d`` takes the largest t that fits in a node
  and divides the heads, the vocabulary and the workers (:func:`tp_size_for`) and adds
  data parallelism over the other workers, as disttrain's ``3d`` runs it: DataParallel's
  buckets of the shard's gradients (:func:`~disttrain.parallel.ddp.buckets.plan_buckets`),
  each all-reduced over the dp group (ranks t apart, across nodes) as soon as backward has
  produced it, on a link of their own (the NIC, while TP uses the node's fabric);
* memory: model states of Ψ/t parameters, and the blocks' activations scaled by the
  activation formula's ratio for t (and sequence parallelism) to t = 1.

The model must be a transformer with known sizes (``ModelProfile.transformer``): the
registered ``transformer`` (measured here) or the analytic ``gpt-1.3b``/``gpt-13b``.
"""

from __future__ import annotations

from disttrain.parallel.ddp.buckets import MIB, plan_buckets
from disttrain.parallel.tensor.theory import (
    Collective,
    LMShape,
    block_activation_elements,
    tp_collectives,
)
from disttrain.simulate import memory
from disttrain.simulate.base import Case, StepResult, not_applicable
from disttrain.simulate.collectives import Group
from disttrain.simulate.data_parallel import issue_collective
from disttrain.simulate.events import Simulation


def tp_size_for(shape: LMShape, workers: int, per_node: int, sequence_parallel: bool) -> int:
    """The largest TP size that stays in a node and divides the workers, the heads, the
    vocabulary (and, with sequence parallelism, the sequence)."""
    fits = [t for t in range(1, min(workers, per_node) + 1)
            if not split_error(shape, t, sequence_parallel) and workers % t == 0]
    return max(fits)


def split_error(shape: LMShape, t: int, sequence_parallel: bool) -> str | None:
    """Why ``shape`` cannot be split ``t`` ways (None: it can)."""
    dims = [("n_heads", shape.n_heads), ("vocab_size", shape.vocab_size)]
    if sequence_parallel:
        dims.append(("sequence length", shape.max_len))
    for name, value in dims:
        if value % t:
            return f"{name}={value} does not divide by tp {t}"
    return None


def layer_collectives(shape: LMShape, batch: int, t: int, sequence_parallel: bool,
                      element_bytes: int) -> list[tuple[list[Collective], list[Collective]]]:
    """(forward, backward) collectives of each layer (0: embedding … L + 2: head and loss)
    for ``batch`` sequences on one rank."""
    out = []
    for i in range(shape.n_layers + 3):
        plan = tp_collectives(shape, batch, shape.max_len, t, sequence_parallel,
                              element_bytes, layers=range(i, i + 1))
        out.append(([c for c in plan if "backward" not in c.where],
                    [c for c in plan if "backward" in c.where]))
    return out


def activation_ratio(shape: LMShape, t: int, sequence_parallel: bool) -> float:
    """A block's activations on one rank of t over the unsplit block's (per sample)."""
    s, h, a = shape.max_len, shape.d_model, shape.n_heads
    return (block_activation_elements(s, 1, h, a, t, sequence_parallel)
            / block_activation_elements(s, 1, h, a, 1, False))


def simulate_tp(case: Case, strategy: str, *, sequence_parallel: bool | None = None,
                tp_everywhere: bool | None = None) -> StepResult:
    """Preset ``strategy`` with tensor parallelism: over every worker (``tp_everywhere``:
    ``tp``, ``tp-sp``) or inside a node with dp across (``3d``), with or without
    ``sequence_parallel``. Called with the name alone, the name says which."""
    shape = case.profile.transformer
    if shape is None or case.layers != shape.n_layers + 3:
        return not_applicable(case, strategy, f"tensor parallelism splits a transformer's "
                              f"heads; model {case.profile.name!r} is not one (use "
                              f"--model transformer, gpt-1.3b or gpt-13b)")
    sp = strategy == "tp-sp" if sequence_parallel is None else sequence_parallel
    everywhere = strategy != "3d" if tp_everywhere is None else tp_everywhere
    per_node = case.cluster.devices_per_node
    t = case.workers if everywhere else tp_size_for(shape, case.workers, per_node, sp)
    why = split_error(shape, t, sp)
    if why is not None:
        return not_applicable(case, strategy, f"{why} (tp = workers; '3d' picks a size "
                                              f"that divides)")
    dp = case.workers // t
    wl, batch = case.workload, case.global_batch / dp
    if batch != int(batch):
        return not_applicable(case, strategy, f"global batch {case.global_batch} does not "
                                              f"split over {dp} dp replicas")
    factor = wl.speeds.slowest(case.workers)
    sim = case.simulation()
    case.compute(sim, "compute", case.workers)
    case.link(sim)
    group, sent, algorithms = case.group(t), 0.0, set[str]()
    last: tuple[int, ...] = ()
    if case.overheads.step_s:
        last = (sim.add("loop", "compute", case.overheads.step_s, (), "overhead"),)

    def comm(c: Collective, name: str, on: Group = group) -> None:
        nonlocal last, sent
        seconds, nbytes, algorithm = case.collective(c.op, on, c.numel * c.element_size)
        last = (issue_collective(sim, case, name, seconds, last, c.op),)
        sent += nbytes
        algorithms.add(algorithm)

    plan = layer_collectives(shape, int(batch), t, sp, wl.element_bytes)
    for i, (forward, _) in enumerate(plan):
        last = (sim.add(f"F{i}", "compute", case.forward(i, batch, factor) / t, last,
                        "forward"),)
        for k, c in enumerate(forward):
            comm(c, f"F{i}:{c.op}{k}")
    done: dict[int, tuple[int, ...]] = {}  # layer → its backward (and TP collectives) done
    for i in reversed(range(len(plan))):
        last = (sim.add(f"B{i}", "compute", case.backward(i, batch, factor) / t, last,
                        "backward"),)
        for k, c in enumerate(plan[i][1]):
            comm(c, f"B{i}:{c.op}{k}")
        done[i] = last
    if sp and t > 1:
        comm(Collective("all_reduce", shape.sequence_parallel_params(), wl.element_bytes,
                        "sequence-parallel gradients"), "sp-grads")
    reduced = list(last)
    if dp > 1:
        dp_group = case.group(dp, stride=t)
        case.link(sim, "dplink")
        sizes = [max(1, lay.params * wl.element_bytes // t) for lay in case.profile.layers]
        for b, bucket in enumerate(plan_buckets(sizes, [0] * len(sizes),
                                                int(wl.first_bucket_mb * MIB),
                                                int(wl.bucket_mb * MIB))):
            seconds, nbytes, algorithm = case.collective("all_reduce", dp_group,
                                                         sum(sizes[i] for i in bucket))
            reduced.append(sim.add(f"dp{b}", "dplink", seconds, done[min(bucket)], "comm"))
            sent += nbytes
            algorithms.add(algorithm)
    sim.add("opt", "compute", case.optimizer(case.profile.params / t,
                                             max(1, case.profile.tensors)), tuple(reduced),
            "optimizer")
    return _result(case, strategy, sim, shape, t, dp, sp, sent, algorithms, factor)


def _result(case: Case, strategy: str, sim: Simulation, shape: LMShape, t: int, dp: int,
            sp: bool, sent: float, algorithms: set[str], factor: float) -> StepResult:
    step = sim.run()
    compute_s = sim.busy("compute")
    wl, batch = case.workload, case.global_batch / dp
    ratio = activation_ratio(shape, t, sp)
    saved = sum(lay.saved_bytes_per_sample * (ratio if 0 < i <= shape.n_layers else 1 / t)
                for i, lay in enumerate(case.profile.layers))
    states = memory.model_states(0, case.profile.params // t, 1, wl.element_bytes,
                                 wl.k_bytes).total
    mem = states + memory.activations(saved, batch, wl.element_bytes)
    exposed = max(0.0, step - compute_s)
    inside = t <= case.cluster.devices_per_node
    where = "inside a node" if inside else f"across {-(-t // case.cluster.devices_per_node)} " \
                                           f"nodes"
    notes = [f"tp {t} {where}" + (f" × dp {dp} across nodes" if dp > 1 else ""),
             f"exposed comm {exposed / step:.0%}" if step > 0 else "no comm"]
    if case.cluster.shared_cores and case.workers > case.cluster.shared_cores:
        notes.append(f"{case.workers} ranks share {case.cluster.shared_cores} cores")
    if factor > 1:
        notes.append(f"slowest of {case.workers} workers ×{factor:.2f}")
    return StepResult(strategy, case.workers, case.global_batch, step, case.ideal_s(), mem,
                      sent, case.cluster.device_memory, tuple(notes),
                      {"exposed_comm_s": exposed, "compute_s": compute_s, "tp_size": t,
                       "optimizer_s": case.optimizer(case.profile.params / t,
                                                     max(1, case.profile.tensors)),
                       "dp_size": dp, "sequence_parallel": sp,
                       "algorithm": ",".join(sorted(algorithms - {"none"})) or "none",
                       "events": len(sim)})
