"""Measure every :class:`~disttrain.simulate.overheads.Overheads` quantity of a model
(:func:`measure_overheads`), and the Python work of the strategies' own wrappers on one rank.

A one-rank :class:`~disttrain.comm.Communicator` over :class:`SoloTransport` runs every
collective's machinery (the call, the progress thread, the flight recorder, the wait) but
no algorithm moves a byte: what the real ``DataParallel`` and ZeRO wrappers cost on top of
the plain model, with nothing to communicate, is then their bookkeeping. Collective
*transfers* on p ranks are the α-β-γ model's business; these are the software overheads
around them.

The probes of several processes (:mod:`~disttrain.probe.contention`,
:mod:`~disttrain.probe.ps_probe`, :mod:`~disttrain.probe.stage_probe`) are read here and
turned into the record's prices with the model's own collective costs
(:mod:`~disttrain.simulate.collectives`): measurements flow one way, probe → record → model.
"""

from __future__ import annotations

import copy
import functools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from disttrain.bench.presets import get_preset
from disttrain.comm import CommConfig, Communicator, LinkCosts, Transport
from disttrain.parallel.ddp import DataParallel
from disttrain.parallel.pipeline.partition import layers_of
from disttrain.parallel.zero import STAGES, ZeroConfig
from disttrain.probe import contention, ps_probe, stage_probe
from disttrain.probe.layer_timing import one_pass
from disttrain.probe.timing import (
    backward_call,
    median_time,
    optimizer_costs,
    paired,
    paired_charge,
    tensor_cost,
)
from disttrain.probe.unit_ops import unit_bytes, unit_price
from disttrain.simulate import cluster
from disttrain.simulate.collectives import collective_time, group_of
from disttrain.simulate.overheads import Overheads

# the workload --validate checks the model on (disttrain.probe.validate): the benchmark's
# LeNet preset (SGD, batch 32); the ZeRO-3 probe computes a rank's share of its batch
VALIDATE_PRESET = "lenet-digits"
GLOBAL_BATCH = get_preset(VALIDATE_PRESET).global_batch


class SoloTransport(Transport):
    """A group of one rank: nothing is ever sent (a collective on one rank moves no bytes)."""

    name = "solo"

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return (0,)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> object:  # type: ignore[override]
        raise RuntimeError("SoloTransport has no peer to send to")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> object:  # type: ignore[override]
        raise RuntimeError("SoloTransport has no peer to receive from")

    def subgroup(self, ranks: Sequence[int]) -> Transport | None:
        return self


def solo_comm() -> Communicator:
    return Communicator(SoloTransport(), CommConfig(), costs=LinkCosts())


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _fwd_bwd(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        _loss(model(x)).backward()
    return run


def collective_call(comm: Communicator) -> float:
    """Seconds of one asynchronous all-reduce call plus its wait, nothing to send."""
    x = torch.zeros(1)

    def run() -> None:
        work = comm.all_reduce(x, async_op=True)
        assert work is not None
        work.wait()
    return median_time(run)


def ddp_hook(module: nn.Module, x: torch.Tensor, comm: Communicator, call_s: float) -> float:
    """DDP's reducer per parameter tensor: (wrapped − plain forward+backward − one
    collective call per bucket) / tensors."""
    wrapped = DataParallel(copy.deepcopy(module), comm)
    try:
        extra = paired(_fwd_bwd(module, x), _fwd_bwd(wrapped, x))
        buckets = len(wrapped.buckets)
    finally:
        wrapped.reducer.remove_hooks()
    tensors = sum(1 for p in module.parameters() if p.requires_grad)
    return max(0.0, (extra - buckets * call_s) / max(1, tensors))


def zero_work(stage: int, module: nn.Module, x: torch.Tensor, comm: Communicator,
              call_s: float, sgd: tuple[float, float]) -> float:
    """The ZeRO ``stage`` wrapper's own work per step on one rank: its step minus the plain
    forward+backward, its collective calls and its SGD step on the flat shard."""
    net = copy.deepcopy(module)
    quiet = logging.getLogger("disttrain.parallel.zero")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # the wrapper logs its layout at INFO
    try:
        zero = STAGES[stage](net, comm, lambda ps: torch.optim.SGD(ps, lr=0.0, momentum=0.9),
                             ZeroConfig())
    finally:
        quiet.setLevel(level)
    model = zero if isinstance(zero, nn.Module) else net

    def step() -> None:
        zero.zero_grad(set_to_none=True)
        _loss(model(x)).backward()
        zero.step()

    calls = _calls(comm)
    step()
    per_step = _calls(comm) - calls
    extra = paired(_fwd_bwd(module, x), step)
    nbytes = sum(p.numel() * 4 for p in module.parameters() if p.requires_grad)
    return max(0.0, extra - per_step * call_s - (sgd[0] + nbytes * sgd[1]))


def _calls(comm: Communicator) -> int:
    return sum(op["calls"] for op in comm.stats.snapshot().values())


def _wakeup(in_step: float, call: float, nbytes: int, ranks: int, transport: str,
            op: str = "all_reduce") -> float:
    """What a ring ``op`` of ``nbytes`` on ``ranks`` ranks took in a step (``in_step``)
    beyond what the simulation charges it: the call's software overhead and the calibrated
    ring on this machine (``local(transport)``). At least 0; 0 when the probe failed."""
    if in_step <= 0:
        return 0.0
    here = cluster.local(transport)
    calibrated, _ = collective_time(here, op, "ring", group_of(here, ranks), nbytes)
    return max(0.0, in_step - call - calibrated)


def _rounds(probes: dict[str, Callable[[], Any]], rounds: int = 3) -> dict[str, list[Any]]:
    """``rounds`` readings of every probe, taken round-robin rather than each probe's in a
    row: this machine has slow spells of tens of seconds, which then slow one reading of
    every probe (that the median or the least of three leaves out) instead of every
    reading of one probe."""
    readings: dict[str, list[Any]] = {name: [] for name in probes}
    for _ in range(rounds):
        for name, probe in probes.items():
            readings[name].append(probe())
    return readings


class _Interference(NamedTuple):
    """The probes of ranks sharing this machine's cores, aggregated."""

    in_step: dict[tuple[str, int], float]  # (op, ranks) → seconds of the collective
    pull: float
    push: float
    served: float
    message: float
    stage_wakeup: float
    unit_ops: dict[int, float]  # ranks → seconds ZeRO-3's collectives add to a step
    unit_work: dict[int, float]  # ranks → that probe's compute per unit and pass
    stage_works: dict[int, float]  # ranks → a GPipe stage's own work per message
    crossing: dict[int, float]  # ranks → a 1F1B stage's own work per message beyond GPipe's


def _unit_work(module: nn.Module, x: torch.Tensor, ranks: int,
               units: int) -> tuple[Callable[[], object], float]:
    """A rank's computation per collective in ZeRO-3's pattern with ``ranks`` ranks, and
    its seconds: its forward+backward at its share of the global batch ``disttrain bench``
    and ``--validate`` train with (:data:`GLOBAL_BATCH`, ``x``'s rows
    repeated), divided over the units' two passes."""
    batch = max(len(x), GLOBAL_BATCH // ranks)
    rows = x.repeat(-(-batch // len(x)), *([1] * (x.dim() - 1)))[:batch]
    seconds = median_time(_fwd_bwd(module, rows)) / (2 * max(1, units))
    return contention.compute_slice(seconds), seconds


def _interference(module: nn.Module, layers: Sequence[nn.Module], x: torch.Tensor,
                  nbytes: int, cores: int, transport: str,
                  bind_cores: bool = False) -> _Interference:
    """The gradients' all-reduce (and ZeRO's reduce-scatter) in a step, with 2 ranks and
    with twice as many ranks as cores (4 on this project's 2, as --validate runs them), a
    parameter-server exchange, a pipeline message and a pipeline stage's own work per
    message in GPipe and 1F1B (on 2 stages and, where the model has the layers, on as many
    as those ranks) on ``transport``: three readings of each, taken round-robin
    (:func:`_rounds`). Nothing with fewer than 2 cores.

    ``bind_cores`` (the runs to predict are bound, ``disttrain bench --bind-cores``): every
    probe but the parameter server's binds its ranks as those runs do (a core each, or two
    to a core for 4 ranks on 2 cores): where ranks share a core, and which, decides what
    waking one costs. The parameter-server probe (1 and 2 workers and a server) is never
    bound, as its runs (3 and 5 processes on 2 cores) are not. Unbound probes read what
    unbound ranks pay, not what bound runs pay: a 4-rank reduce-scatter's wake-up read
    1.23-1.33 ms unbound against 0.51-0.57 ms bound two to a core."""
    probed = [] if cores < 2 else [2, 2 * cores] if cores <= 4 else [2]
    units = unit_bytes(layers)
    unit_work = {ranks: _unit_work(module, x, ranks, len(units)) for ranks in probed}
    probes = _probes(module, len(layers), x, nbytes, cores, transport, bind_cores, probed,
                     {ranks: work for ranks, (work, _) in unit_work.items()}, units)
    readings = _rounds(probes)
    # The collectives: the median of three. One measurement moves by milliseconds within
    # minutes (where the kernel places the ranks). Not the least, as for compute: this is
    # the ranks' interference itself, and the benchmark's runs draw their placement too
    in_step = {(op, ranks): statistics.median(readings[f"{op}:{ranks}"])
               for op in ("all_reduce", "reduce_scatter") for ranks in probed}
    # The least of three, the pull and the push each on its own: one worker and one server
    # have a core each, so a slow reading is other load on the machine. (Compute and the
    # validation's runs take medians; this keeps the least as long as the median is not
    # shown to predict better.) The share a second worker adds is a difference of
    # two runs: the median of three. A probe that failed (0) is not a reading
    exchanges = readings.get("ps", [(0.0, 0.0, 0.0)])
    pull, push = (min((e[i] for e in exchanges if e[i] > 0), default=0.0) for i in (0, 1))
    served = [e[2] for e in exchanges if e[2] > 0]
    # a pipeline message, busy and after idling: the median of three, as the collectives
    messages = readings.get("stage", [(0.0, 0.0)])
    message, stage_wakeup = (statistics.median(m[i] for m in messages) for i in (0, 1))
    # and a stage's own work per message, GPipe's and 1F1B's excess over it in the same
    # processes, by stage count: the median of three likewise (a failed probe reads {})
    own = {int(key.split(":")[1]): [r for r in values if r]
           for key, values in readings.items() if key.startswith("stage_work:") and any(values)}
    return _Interference(in_step, pull, push,
                         min(statistics.median(served), pull + push) if served else 0.0,
                         message, stage_wakeup,
                         {ranks: statistics.median(readings[f"units:{ranks}"])
                          for ranks in probed},
                         {ranks: seconds for ranks, (_, seconds) in unit_work.items()},
                         {ranks: statistics.median(r["gpipe"] for r in rs)
                          for ranks, rs in own.items()},
                         {ranks: statistics.median(max(0.0, r["1f1b"] - r["gpipe"]) for r in rs)
                          for ranks, rs in own.items()})


def _probes(module: nn.Module, max_stages: int, x: torch.Tensor, nbytes: int, cores: int,
            transport: str, bind: bool, probed: list[int],
            unit_work: dict[int, Callable[[], object]], units: list[int]
            ) -> dict[str, Callable[[], Any]]:
    """:func:`_interference`'s probes by name, each ready to take one reading (``max_stages``:
    the model's layers, the most pipeline stages it can be split into). Each probe is
    looked up on its module when the probes are made, so a test can stand in for one."""
    probes: dict[str, Callable[[], Any]] = {
        f"{op}:{ranks}": functools.partial(contention.collective_in_step, _fwd_bwd(module, x),
                                           nbytes, transport=transport, ranks=ranks, op=op,
                                           bind=bind)
        for op in ("all_reduce", "reduce_scatter") for ranks in probed}
    probes.update({f"units:{ranks}": functools.partial(
        contention.unit_ops_in_step, unit_work[ranks], units, transport=transport,
        ranks=ranks, bind=bind) for ranks in probed})
    if cores > 1:  # the parameter server's never bound: its runs are not
        probes["ps"] = functools.partial(ps_probe.ps_exchange, module, _fwd_bwd(module, x),
                                         transport)
        probes["stage"] = functools.partial(stage_probe.stage_message, _fwd_bwd(module, x),
                                            transport, bind=bind)
        # both schedules on 2 stages, and on as many as validated where the model has the
        # layers for them
        probes.update({f"stage_work:{ranks}": functools.partial(
            stage_probe.stage_work, module, x, transport, ranks, bind=bind)
            for ranks in sorted({2, *probed}) if ranks == 2 or ranks <= max_stages})
    return probes


def loop_cost(module: nn.Module, x: torch.Tensor, loop: Callable[[], object],
              sgd_step: float, repeats: int = 21, rounds: int = 3,
              layers: Sequence[nn.Module] | None = None) -> float:
    """``Overheads.step_s``: ``loop`` (one whole step of the training loop on a batch of
    ``x``'s size) less what the simulation charges for the model in it, the sum of the
    layers' times in one of the profile's passes over ``x``
    (:func:`~disttrain.probe.layer_timing.one_pass`), less ``sgd_step``, the optimizer step
    it charges on its own. The two run alternately, so the machine's drift hits both; the
    median difference over ``repeats`` pairs, the least of ``rounds`` such medians
    (:func:`~disttrain.probe.timing.paired_charge`). What is left is the loop's own
    work (the batch fetched, ``zero_grad``, the loss and the start of backward, which no
    layer's time holds, ``float(loss)``, the strategy's bookkeeping) and what the
    optimizer pays in a step beyond its time alone (its tensors cold after backward).
    The real loop, not a copy of its work: a copy (0.22-0.29 ms on LeNet) leaves out what
    the real step pays and predicts the single process at 0.80-0.97 of its runs. Against
    the layers' sum, not a plain forward+backward, which would miss the loss and the start
    of backward (0.11-0.15 ms at batch 4 and 32). ``layers``: the model's split, when the
    caller has it (:func:`measure_overheads`), else ``layers_of(module)``."""
    split, plain = list(layers_of(module) if layers is None else layers), _fwd_bwd(module, x)

    def charged() -> float:
        """Seconds the simulation charges for the model's pass over ``x``."""
        start = time.perf_counter()
        times = one_pass(split, x)
        if times is None:  # the layers cannot be timed in a pass: the whole of it
            plain()
            return time.perf_counter() - start
        return sum(f + b for f, b in times)

    return max(0.0, paired_charge(charged, loop, repeats, rounds) - sgd_step)


def measure_overheads(module: nn.Module, x: torch.Tensor,
                      loop: Callable[[], object] | None = None, cores: int = 1,
                      transport: str = "torch", bind_cores: bool = False,
                      layers: Sequence[nn.Module] | None = None) -> Overheads:
    """Every :class:`Overheads` quantity for ``module`` on input ``x`` (one thread is the
    caller's business). ``loop`` runs one whole step of the training loop on a batch of
    ``x``'s size (:func:`loop_cost` makes ``step_s`` of it); ``cores`` > 1
    measures ``concurrent_slowdown`` with that many processes, the wake-up of a
    collective, a parameter-server pull and push, a pipeline message and a stage's own
    work per message on ``transport``, for runs bound to cores or not (``bind_cores``, as
    ``disttrain bench --bind-cores``; see :func:`_interference`). ``layers``: the model's
    split, when the caller has it (the profile does), else ``layers_of(module)``; every
    probe times that one split."""
    split = list(layers_of(module) if layers is None else layers)
    sgd = optimizer_costs(lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))
    adam = optimizer_costs(lambda ps: torch.optim.Adam(ps, lr=1e-3))
    params = [p for p in module.parameters() if p.requires_grad]
    # before any thread starts (it forks). The least of three: other load on the machine
    # needs a free core to hurt one process, two to hurt the pair, and inflates the ratio
    slowdown = min(contention.concurrent_slowdown(_fwd_bwd(module, x), cores)
                   for _ in range(3))
    nbytes = sum(p.numel() * 4 for p in params)
    shared = _interference(module, split, x, nbytes, cores, transport, bind_cores)
    after = median_time(_fwd_bwd(module, x)) if cores > 1 else 0.0  # the probe's compute
    tensor = tensor_cost(params, sgd[0], sgd[1])
    step = loop_cost(module, x, loop, sgd[0] + nbytes * sgd[1] + max(0, len(params) - 1)
                     * tensor, layers=split) if loop is not None else 0.0
    module.zero_grad(set_to_none=True)
    comm = solo_comm()
    try:
        call = collective_call(comm)
        wakeup = {ranks: _wakeup(took, call, nbytes, ranks, transport, op)
                  for (op, ranks), took in shared.in_step.items() if op == "all_reduce"}
        scatter = {ranks: _wakeup(took, call, nbytes, ranks, transport, op)
                   for (op, ranks), took in shared.in_step.items() if op == "reduce_scatter"}
        units = {ranks: unit_price(took, unit_bytes(split), ranks, transport,
                                  shared.unit_work.get(ranks, 0.0))
                 for ranks, took in shared.unit_ops.items()}
        hook = ddp_hook(module, x, comm, call)
        zero = {k: zero_work(k, module, x, comm, call, sgd) for k in (1, 2, 3)}
    finally:
        comm.close()
        module.zero_grad(set_to_none=True)  # the model as it came
    return Overheads(step_s=step,
                     sgd_fixed_s=sgd[0], sgd_s_per_byte=sgd[1], adam_fixed_s=adam[0],
                     adam_s_per_byte=adam[1], optimizer_tensor_s=tensor,
                     collective_call_s=call, hook_s_per_tensor=hook,
                     backward_call_s=backward_call(), zero_s=zero,
                     collective_wakeup_s=wakeup.pop(2, 0.0), collective_wakeup_after_s=after,
                     wakeup_by_ranks=wakeup, scatter_wakeup_by_ranks=scatter,
                     unit_op_by_ranks=units,
                     ps_pull_s=shared.pull, ps_push_s=shared.push, ps_served_s=shared.served,
                     stage_message_s=shared.message, stage_wakeup_s=shared.stage_wakeup,
                     stage_work_s=shared.stage_works.pop(2, 0.0),
                     stage_work_by_ranks=shared.stage_works, crossing_by_ranks=shared.crossing,
                     concurrent_slowdown=slowdown)
