"""Context parallelism (``cp``) and expert parallelism (``ep``) at scale: a step of each, by
its degree and options, on the cluster model.

**cp** (every worker in one cp group): each rank holds ``1/cp`` of every sequence and
computes its blocks on it (the zig-zag split balances causal attention); per block, the
ring variant passes every other rank's key/value block around the ring in forward (an
all-gather of K and V, overlapped with attention) and key/values plus their gradients in
backward (an all-gather and a reduce-scatter); Ulysses moves q, k, v and the output by
all-to-all over heads instead (4 per block each way). The replicated parameters' gradients
are then all-reduced over the cp ranks (they saw different tokens of the same samples).
Saved activations per rank are ``1/cp`` of one process's: what makes long sequences fit.

**ep** (every worker in one ep group, each reading its own samples): a mixture-of-experts
layer sends each token's ``k`` copies to their experts' ranks and back, in forward and
backward (4 all-to-alls of ``(ep − 1)/ep`` of the routed rows); the replicated parameters
are all-reduced over ep, each expert's live on one rank. A profile without experts
(``ModelProfile.moe``) is not applicable.
"""

from __future__ import annotations

from disttrain.parallel.ddp.buckets import MIB, plan_buckets
from disttrain.simulate import memory
from disttrain.simulate.base import Case, StepResult, not_applicable
from disttrain.simulate.data_parallel import issue_collective

RING, ULYSSES = "ring", "ulysses"


def simulate_cp(case: Case, name: str, variant: str = RING) -> StepResult:
    shape = case.profile.transformer
    if shape is None or case.layers != shape.n_layers + 3:
        return not_applicable(case, name, "context parallelism splits a transformer's "
                                          "sequences; this model is not one")
    cp, s = case.workers, shape.max_len
    if s % (2 * cp):
        return not_applicable(case, name, f"sequences of {s} tokens do not cut into 2 × cp = "
                                          f"{2 * cp} zig-zag chunks")
    if variant == ULYSSES and shape.n_heads % cp:
        return not_applicable(case, name, f"Ulysses splits {shape.n_heads} heads, which do "
                                          f"not divide over cp = {cp}")
    wl, batch = case.workload, float(case.global_batch)
    factor = wl.speeds.slowest(case.workers)
    sim = case.simulation()
    case.compute(sim, "compute", case.workers)
    case.link(sim)
    group, sent = case.group(cp), 0.0
    kv = 2 * batch * s * shape.d_model * wl.element_bytes  # K and V of whole sequences
    last: tuple[int, ...] = ()

    def exchange(op: str, nbytes: float, tag: str, after: tuple[int, ...]) -> int:
        nonlocal sent
        seconds, moved, _ = _collective(case, op, group, nbytes)
        sent += moved
        return issue_collective(sim, case, tag, seconds, after, op)

    blocks = range(1, shape.n_layers + 1)
    for i in range(case.layers):
        work = sim.add(f"F{i}", "compute", case.forward(i, batch, factor) / cp, last,
                       "forward")
        if i in blocks:
            comm = exchange("all_gather", kv, f"F{i}:kv", last) if variant == RING else \
                exchange("all_to_all", 2 * kv, f"F{i}:a2a", last)
            last = (work, comm)
        else:
            last = (work,)
    for i in reversed(range(case.layers)):
        work = sim.add(f"B{i}", "compute", case.backward(i, batch, factor) / cp, last,
                       "backward")
        if i in blocks:
            first = exchange("all_gather" if variant == RING else "all_to_all",
                             kv if variant == RING else 2 * kv, f"B{i}:kv", last)
            second = exchange("reduce_scatter" if variant == RING else "all_to_all",
                              kv if variant == RING else 2 * kv, f"B{i}:dkv", (first,))
            last = (work, second)
        else:
            last = (work,)
    grads, optimizer_s = _update(case, sim, group, last, params=case.profile.params)
    return _result(case, name, sim, sent + grads, optimizer_s, cp, saved_fraction=1 / cp,
                   batch=batch, params=case.profile.params, notes=(f"cp {cp} ({variant})",))


def simulate_ep(case: Case, name: str) -> StepResult:
    moe = case.profile.moe
    if moe is None:
        return not_applicable(case, name, "expert parallelism spreads mixture-of-experts "
                                          "experts; this model has none (use a -moe preset)")
    experts, top_k, moe_layers, expert_params = moe
    ep = case.workers
    if experts % ep:
        return not_applicable(case, name, f"{experts} experts do not divide over ep = {ep}")
    wl = case.workload
    batch = case.global_batch / ep
    if batch != int(batch):
        return not_applicable(case, name, f"global batch {case.global_batch} does not split "
                                          f"over {ep} ranks")
    shape = case.profile.transformer
    width = shape.d_model if shape is not None else 1
    tokens = batch * (shape.max_len if shape is not None else 1)
    routed = tokens * top_k * width * wl.element_bytes  # each token's k copies
    factor = wl.speeds.slowest(case.workers)
    sim = case.simulation()
    case.compute(sim, "compute", case.workers)
    case.link(sim)
    group, sent = case.group(ep), 0.0
    last: tuple[int, ...] = ()
    moe_set = set(moe_layers)
    for direction in ("F", "B"):
        order = range(case.layers) if direction == "F" else reversed(range(case.layers))
        for i in order:
            run = case.forward if direction == "F" else case.backward
            last = (sim.add(f"{direction}{i}", "compute", run(i, batch, factor), last,
                            "forward" if direction == "F" else "backward"),)
            if i in moe_set:
                for k in range(2):  # dispatch, then combine
                    seconds, moved, _ = _collective(case, "all_to_all", group, routed)
                    sent += moved
                    last = (issue_collective(sim, case, f"{direction}{i}:a2a{k}", seconds,
                                             last, "all_to_all"),)
    replicated = case.profile.params - expert_params
    grads, optimizer_s = _update(case, sim, group, last, skip_params=expert_params,
                                 params=replicated + expert_params // ep)
    return _result(case, name, sim, sent + grads, optimizer_s, ep, saved_fraction=1.0, batch=batch,
                   params=replicated + expert_params // ep,
                   notes=(f"ep {ep}: {experts // ep} of {experts} experts per rank",))


def _collective(case: Case, op: str, group: object, nbytes: float) -> tuple[float, float, str]:
    """A collective's (seconds, bytes sent, algorithm); an all-to-all of ``nbytes`` per rank
    is priced as the all-gather that sends as much ((p − 1)/p of it to the others)."""
    if op == "all_to_all":
        op = "all_gather"
    return case.collective(op, group, nbytes)  # type: ignore[arg-type]


def _update(case: Case, sim: object, group: object, after: tuple[int, ...],
            skip_params: int = 0, *, params: int) -> tuple[float, float]:
    """The replicated gradients' all-reduce over the group, in DDP's buckets, then the
    optimizer's step over the rank's ``params``: (bytes sent, optimizer seconds)."""
    wl, sent, reduces = case.workload, 0.0, []
    total = max(1, (case.profile.params - skip_params) * wl.element_bytes)
    scale = total / max(1, case.profile.params * wl.element_bytes)
    sizes = [max(1, int(lay.params * wl.element_bytes * scale)) for lay in case.profile.layers]
    for b, bucket in enumerate(plan_buckets(sizes, [0] * len(sizes),
                                            int(wl.first_bucket_mb * MIB),
                                            int(wl.bucket_mb * MIB))):
        seconds, nbytes, _ = case.collective("all_reduce", group,  # type: ignore[arg-type]
                                             sum(sizes[i] for i in bucket))
        reduces.append(sim.add(f"grads{b}", "link", seconds, after,  # type: ignore
                               "comm"))
        sent += nbytes
    tensors = max(1, round(case.profile.tensors * params / max(1, case.profile.params)))
    optimizer_s = case.optimizer(params, tensors)
    sim.add("opt", "compute", optimizer_s, tuple(reduces), "optimizer")  # type: ignore
    return sent, optimizer_s


def _result(case: Case, name: str, sim: object, sent: float, optimizer_s: float,
            degree: int, *,
            saved_fraction: float, batch: float, params: int,
            notes: tuple[str, ...]) -> StepResult:
    wl = case.workload
    step = sim.run()  # type: ignore[attr-defined]
    compute_s = sim.busy("compute")  # type: ignore[attr-defined]
    saved = sum(lay.saved_bytes_per_sample for lay in case.profile.layers) * saved_fraction
    states = memory.model_states(0, params, 1, wl.element_bytes, wl.k_bytes).total
    mem = states + memory.activations(saved, batch, wl.element_bytes)
    exposed = max(0.0, step - compute_s)
    return StepResult(name, case.workers, case.global_batch, step, case.ideal_s(), mem, sent,
                      case.cluster.device_memory,
                      (*notes, f"exposed comm {exposed / step:.0%}" if step > 0 else ""),
                      {"exposed_comm_s": exposed, "compute_s": compute_s, "degree": degree,
                       "optimizer_s": optimizer_s})
