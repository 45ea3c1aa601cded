"""Model parallelism and pipelines (GPipe, 1F1B; pp × dp grids), simulated from the
pipeline's own schedule tables.

The model's layers are cut into pp contiguous stages by
:func:`~disttrain.parallel.pipeline.partition.balance_by_cost` as the workload's
``partition`` says: on parameter counts (``"params"``, the default of disttrain's pipelines,
so a prediction is for the split that actually runs) or on profiled forward + backward time
(``"time"``). :func:`~disttrain.parallel.pipeline.schedules.get_schedule` gives each
stage's action list (``rA0 F0 sA0 … rG0 B0 sG0``); every compute action becomes a task on
the stage's compute stream (a backward also pays one autograd call,
``Overheads.backward_call_s``: a stage back-propagates each micro-batch with its own
``torch.autograd.backward``), every send a task on its link (α + activation bytes · β,
intra- or inter-node depending on where the neighbour sits; on this machine, the constants
calibrated with as many ranks as cores, the link sharing the cores with compute, and at
least the probed cost of a message between stages, ``Overheads.stage_message_s``; model
parallelism, one message at a time as in the probe, pays the probe alone),
and every receive a dependency on the matching send. On this machine a stage also works
``Overheads.stage_work_s`` on its own compute stream per message it sends (before the
send) and per message it takes in (before the computation that follows; probed on the
real runtime on 2 stages and on as many as ``--validate`` runs, the probe with the most
stages not above the step's; a 1F1B stage more, ``Overheads.crossing``, its messages
crossing each connection both ways at once), and the link keeps the message's price less
both ends' share; the stage's
first task after a receive also pays ``Overheads.stage_wakeup_s`` in proportion to how
long it sat idle before it. A step is simulated as in a run of consecutive steps: the first
stage runs the training loop's own work (``Overheads.step_s``) before its first forward,
every other stage after its optimizer, overlapping the stages still going backward. The
bubble, the idle time at the start and end of the step, comes out of the simulation: with
equal stage times and free messages it is (p − 1)/(m + p − 1).

Every pipeline replica of a pp × dp grid is the same, so one replica is simulated; after
its backward each stage all-reduces its gradients with its dp copies (ranks pp apart).
Model parallelism is the schedule with one micro-batch (m = 1) and pp = every device.
"""

from __future__ import annotations

from disttrain.parallel.pipeline.partition import balance_by_cost, boundaries
from disttrain.parallel.pipeline.schedules import (
    Backward,
    Forward,
    RecvAct,
    RecvGrad,
    Schedule,
    SendAct,
    get_schedule,
)
from disttrain.simulate import memory
from disttrain.simulate.base import Case, StepResult, not_applicable

DEFAULT_MAX_STAGES = 8


class _Replica:
    """One pipeline replica's tasks, built by walking the schedule in dependency order."""

    def __init__(self, case: Case, schedule: Schedule, bounds: list[tuple[int, int]],
                 micro: float, factor: float, dp: int) -> None:
        self.case, self.schedule, self.bounds = case, schedule, bounds
        self.micro, self.factor = micro, factor
        self.sim = case.simulation()
        self.sent: dict[tuple[str, int, int], int] = {}  # (kind, to stage, mb) → send task
        self.last_compute: dict[int, int] = {}
        self.bytes = [0.0] * schedule.num_stages
        for s in range(schedule.num_stages):  # a stage stands for its dp copies
            case.compute(self.sim, f"compute{s}", dp)
            case.compute(self.sim, f"link{s}", dp)  # messages need a core too (see link)
        # Every stage runs the training loop's own work each step (fetch, zero_grad, ...:
        # Overheads.step_s). In the steady state of consecutive steps only the first
        # stage's is on the critical path, before its first forward: the other stages
        # finish their step earlier and run the next one's loop while the stages before
        # them still go backward (see _finish; should one outlast the first stage's tail,
        # the step ends with it, an upper bound). Put at this step's start, all pp loops
        # would share the cores at once; with 4 stages on this host's 2 cores that doubled
        # the first stage's and put model parallelism on 4 ranks at 1.20-1.21 of its
        # runs in two validations (docs/simulate.md).
        if case.overheads.step_s:
            self.last_compute[0] = self.loop(0)

    def loop(self, stage: int, deps: tuple[int, ...] = ()) -> int:
        """The task of ``stage``'s training-loop work (``Overheads.step_s``) after ``deps``."""
        return self.sim.add(f"loop@{stage}", f"compute{stage}", self.case.overheads.step_s,
                            deps, "overhead")

    def link(self, stage: int, to: int, nbytes: float) -> float:
        dpn = self.case.cluster.devices_per_node
        same_node = stage // dpn == to // dpn  # one replica's stages are contiguous ranks
        cluster = self.case.cluster
        costs = cluster.intra_link() if same_node else cluster.inter_link()
        # A message joins two ranks. Where ranks share cores (this machine), it costs what
        # the calibration measured with no more ranks than cores, and the engine stretches
        # it while more tasks than cores run (its link is on the shared cores): the
        # constants calibrated on 4 ranks of 2 cores already include that sharing, and
        # would charge it twice, or charge it to model parallelism, where one stage works
        # at a time.
        ranks = min(self.case.workers, cluster.shared_cores or self.case.workers)
        costs = costs.at(max(2, ranks))
        # What a message costs here besides its bytes, as probed through the stage links
        # (Overheads.stage_message_s: both stages' Python, the transport's latency). Model
        # parallelism sends one message at a time while the other stages wait, as in the
        # probe, so the probe is its price. With micro-batches in flight every stage
        # computes while messages move, and the transport's threads take their cycles from
        # that compute: such a message costs at least the calibrated α, measured with every
        # rank busy (on Gloo here 0.77 ms against a probe of 0.25-0.32 ms; with the probe
        # alone GPipe and 1F1B read 0.50-0.83 of their measured steps, model parallelism
        # on 4 ranks with α 1.25-1.33: docs/simulate.md, "Overheads"). Of that price, the
        # work each of the two stages does on its own thread is charged to the stages
        # (Overheads.stage_work_s, see step): the link keeps the rest, the time the message
        # is in flight while both stages compute
        probed = self.case.overheads.stage_message_s if self.on_host(stage, to) else 0.0
        price = probed if probed and self.schedule.num_microbatches == 1 else \
            max(costs.alpha, probed)
        return max(0.0, price - 2 * self.own(stage, to)) + nbytes * costs.beta

    def on_host(self, stage: int, to: int) -> bool:
        """Both stages are processes on this machine's shared cores, where the profile's
        probes of a pipeline message apply."""
        dpn = self.case.cluster.devices_per_node
        return bool(self.case.cluster.shared_cores) and stage // dpn == to // dpn

    def work(self, stage: int, to: int) -> float:
        """What a stage spends on its own thread to send a message from ``stage`` to ``to``
        or to take one in: its share of the message (:meth:`own`) and, in 1F1B, what its
        messages crossing the connections both ways cost it more
        (``Overheads.crossing``, probed with the same number of stages on this machine's
        runtime: on 4 Gloo ranks its runs took 5-40 % longer than GPipe's where the
        simulation put both at about the same step; docs/simulate.md, "Why the model is
        built this way")."""
        own = self.own(stage, to)
        if own and self.schedule.name == "1f1b":
            return own + self.case.overheads.crossing(self.case.workers)
        return own

    def own(self, stage: int, to: int) -> float:
        """A stage's own work for one message that is part of the message's probed price
        (``Overheads.stage_work``: probed on this machine's runtime with GPipe, on the most
        stages not above the step's ranks; on 4 Gloo ranks here 0.16-0.18 ms against
        0.13-0.14 ms on 2). In model parallelism the probe is the whole message's price,
        so each end's share is at most half of it (stage_work_s, probed on GPipe's runtime,
        read 0.24-0.47 ms against probes of 0.28-0.42 ms in seven validations, and twice it
        per message put model parallelism on 4 ranks at 1.16-1.30 of its runs:
        docs/simulate.md, "Why the model is built this way")."""
        ov = self.case.overheads
        if not self.on_host(stage, to):
            return 0.0
        own = ov.stage_work(self.case.workers)
        return min(own, ov.stage_message_s / 2) if self.schedule.num_microbatches == 1 else own

    def stage_time(self, stage: int, backward: bool) -> float:
        lo, hi = self.bounds[stage]
        f = self.case.backward if backward else self.case.forward
        call = self.case.overheads.backward_call_s if backward else 0.0
        return call + sum(f(i, self.micro, self.factor) for i in range(lo, hi))

    def boundary_bytes(self, stage: int) -> float:
        lay = self.case.profile.layers[self.bounds[stage][1] - 1]
        return lay.output_bytes_per_sample * self.micro * self.case.workload.element_bytes / 4

    def step(self, s: int, action: object) -> bool:
        """Add ``action``'s task; False if it waits for a message not yet sent."""
        mb = getattr(action, "microbatch", 0)
        if isinstance(action, (RecvAct, RecvGrad)):
            return ("act" if isinstance(action, RecvAct) else "grad", s, mb) in self.sent
        if isinstance(action, (Forward, Backward)):
            self.compute(s, action, mb)
        else:
            self.send(s, action, mb)
        return True

    def compute(self, s: int, action: Forward | Backward, mb: int) -> None:
        fwd, sim, ov = isinstance(action, Forward), self.sim, self.case.overheads
        key = ("act", s, mb) if fwd else ("grad", s, mb)
        deps = (self.sent[key],) if key in self.sent else ()
        # a stage that sat idle waiting for this message is woken and computes on cold
        # caches (Overheads.stage_wakeup_s, in full after the probe's idle time); one busy
        # with other micro-batches when it arrived pays nothing
        sender = s - 1 if fwd else s + 1
        wake = ov.stage_wakeup_s if deps and self.on_host(sender, s) else 0.0
        took = self.work(sender, s) if deps else 0.0
        if took:  # it takes the message in on its own thread first, woken if idle
            deps = (sim.add(f"take{action}@{s}", f"compute{s}", took, deps, "overhead",
                            cold_s=wake, cold_after_s=ov.collective_wakeup_after_s),)
            wake = 0.0
        self.last_compute[s] = sim.add(f"{action}@{s}", f"compute{s}",
                                       self.stage_time(s, not fwd), deps,
                                       "forward" if fwd else "backward", cold_s=wake,
                                       cold_after_s=ov.collective_wakeup_after_s)

    def send(self, s: int, action: object, mb: int) -> None:
        forward = isinstance(action, SendAct)
        to = s + 1 if forward else s - 1
        nbytes = self.boundary_bytes(s if forward else to)
        self.bytes[s] += nbytes
        posting = self.work(s, to)
        if posting:  # packed and posted on the stage's own thread, after its computation
            self.last_compute[s] = self.sim.add(f"post{action}@{s}", f"compute{s}", posting,
                                                (), "overhead")
        self.sent[("act" if forward else "grad", to, mb)] = self.sim.add(
            f"{action}@{s}", f"link{s}", self.link(s, to, nbytes), (self.last_compute[s],),
            "comm")

    def build(self) -> None:
        pcs = [0] * self.schedule.num_stages
        pending = True
        while pending:
            progressed, pending = False, False
            for s in range(self.schedule.num_stages):
                actions = self.schedule.actions(s)
                while pcs[s] < len(actions) and self.step(s, actions[pcs[s]]):
                    pcs[s] += 1
                    progressed = True
                pending = pending or pcs[s] < len(actions)
            if pending and not progressed:
                raise RuntimeError(f"{self.schedule.name} schedule deadlocks in simulation")


def default_pp(case: Case) -> int:
    return case.workload.pp_size or min(case.workers, case.layers, DEFAULT_MAX_STAGES)


def simulate_pipeline(case: Case, name: str, pp: int | None = None,
                      microbatches: int | None = None, *, schedule: str | None = None,
                      every_rank: bool | None = None) -> StepResult:
    """Preset ``name`` as a pipeline: ``schedule`` ("gpipe", "1f1b"; default: the name) on
    a pp × dp grid; ``microbatches`` fixed by the preset (model parallelism: 1) or the
    workload's; ``every_rank``: one stage per worker (model parallelism) rather than the
    workload's pp. Called with the name alone, "model-parallel" means GPipe with m = 1
    over every worker."""
    split = name == "model-parallel" if every_rank is None else every_rank
    fixed = 1 if name == "model-parallel" and schedule is None else None
    schedule = schedule or ("gpipe" if name == "model-parallel" else name)
    pp = pp or (case.workers if split else default_pp(case))
    m = fixed or microbatches or case.workload.microbatches
    if pp > case.layers:
        return not_applicable(case, name, f"{pp} stages need ≥ {pp} layers; the model has "
                              f"{case.layers} (use --pp ≤ {case.layers})")
    if case.workers % pp:
        return not_applicable(case, name, f"--pp {pp} does not divide {case.workers} "
                              f"workers")
    dp = case.workers // pp
    replica_batch = case.global_batch / dp
    if replica_batch < m:
        return not_applicable(case, name, f"{replica_batch:g} samples per replica < {m} "
                              f"micro-batches")
    costs = [float(lay.params) for lay in case.profile.layers] \
        if case.workload.partition == "params" else \
        [lay.forward(1) + lay.backward(1) for lay in case.profile.layers]
    bounds = boundaries(balance_by_cost(costs, pp))
    plan = get_schedule(schedule, pp, m)
    factor = case.workload.speeds.slowest(case.workers)
    rep = _Replica(case, plan, bounds, replica_batch / m, factor, dp)
    rep.build()
    sent_dp = _finish(case, rep, pp, dp)
    step = rep.sim.run()
    return _result(case, name, rep, step, sent_dp, pp, dp, m)


def _finish(case: Case, rep: _Replica, pp: int, dp: int) -> list[float]:
    """Each stage: dp all-reduce of its gradients (after its last backward), optimizer;
    then every stage but the first runs the next step's loop."""
    sent = []
    group = case.group(dp, stride=pp)
    for s, (lo, hi) in enumerate(rep.bounds):
        seconds, nbytes, _ = case.collective("all_reduce", group, case.grad_bytes(range(lo, hi)))
        ar = rep.sim.add(f"ar@{s}", f"link{s}", seconds, (rep.last_compute[s],), "comm")
        params = sum(case.profile.layers[i].params for i in range(lo, hi))
        tensors = sum(case.profile.layers[i].tensors for i in range(lo, hi))
        opt = rep.sim.add(f"opt@{s}", f"compute{s}", case.optimizer(params, tensors),
                          (ar,), "optimizer")
        if s and case.overheads.step_s:  # the next step's loop (see _Replica.__init__)
            rep.loop(s, (opt,))
        sent.append(nbytes)
    return sent


def _result(case: Case, name: str, rep: _Replica, step: float, sent_dp: list[float], pp: int,
            dp: int, m: int) -> StepResult:
    wl = case.workload
    idle = [1 - rep.sim.busy(f"compute{s}") / step for s in range(pp)]
    bubble = sum(idle) / pp
    mems, optimizer_s = [], 0.0
    for s, (lo, hi) in enumerate(rep.bounds):
        params = sum(case.profile.layers[i].params for i in range(lo, hi))
        tensors = sum(case.profile.layers[i].tensors for i in range(lo, hi))
        optimizer_s = max(optimizer_s, case.optimizer(params, tensors))  # as _finish charges
        states = memory.model_states(0, params, 1, wl.element_bytes, wl.k_bytes).total
        in_flight = m if rep.schedule.name != "1f1b" else min(pp - s, m)
        saved = sum(case.profile.layers[i].saved_bytes_per_sample for i in range(lo, hi))
        mems.append(states + memory.activations(saved, rep.micro * in_flight,
                                                wl.element_bytes))
    notes = [f"pp={pp} dp={dp}", f"idle {bubble:.0%} at m={m}"]
    sent = max(b + d for b, d in zip(rep.bytes, sent_dp))
    return StepResult(name, case.workers, case.global_batch, step, case.ideal_s(), max(mems),
                      sent, case.cluster.device_memory, tuple(notes),
                      {"pp": pp, "dp": dp, "microbatches": m, "bubble": bubble,
                       "optimizer_s": optimizer_s,
                       "balance": [hi - lo for lo, hi in rep.bounds], "events": len(rep.sim)})
