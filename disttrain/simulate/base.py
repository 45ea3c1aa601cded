"""What every simulated strategy reads (:class:`Case`) and returns (:class:`StepResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from disttrain.simulate.cluster import Cluster
from disttrain.simulate.collectives import Group, bytes_sent, collective_time, group_of
from disttrain.simulate.events import Simulation
from disttrain.simulate.overheads import Overheads
from disttrain.simulate.profile import ModelProfile
from disttrain.simulate.workload import Workload


@dataclass(frozen=True)
class Case:
    """One cell of the table: a model profile on ``workers`` devices of ``cluster``."""

    profile: ModelProfile
    cluster: Cluster
    workload: Workload
    workers: int

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) \
                or self.workers < 1:
            raise ValueError(f"workers must be an integer ≥ 1, got {self.workers!r}")

    @property
    def scale(self) -> float:
        """Reference-device seconds → seconds on one of this cluster's devices, at full
        speed (cores shared by more ranks than there are slow them in the simulation:
        :meth:`simulation`)."""
        return self.cluster.compute_scale(self.profile.reference_flops, 1)

    @property
    def overheads(self) -> Overheads:
        """The profile's measured host-side costs (zero for analytic profiles). They are
        Python on a host CPU, so they are carried to other clusters unscaled."""
        return self.profile.overheads

    @property
    def wakeup(self) -> float:
        """Extra seconds of a collective or parameter-server exchange issued right after
        compute, over its calibrated (back-to-back) cost: measured on this machine, where
        ranks share cores, and only charged there."""
        return self.wakeup_of("all_reduce")

    def wakeup_of(self, op: str) -> float:
        """:attr:`wakeup` for collective ``op`` (a reduce-scatter has its own probe)."""
        return self.overheads.wakeup(self.workers, op) if self.cluster.shared_cores else 0.0

    def simulation(self) -> Simulation:
        """An engine for this case: on a cluster whose devices are processes sharing cores
        (this machine), compute resources declared with a load share those cores, and
        slow each other by the profile's measured ``concurrent_slowdown``."""
        cores = self.cluster.shared_cores
        return Simulation(cores, self.overheads.concurrent_slowdown if cores else 1.0)

    def compute(self, sim: Simulation, name: str, ranks: float, policy: str = "fifo") -> str:
        """Declare compute resource ``name`` standing for ``ranks`` identical ranks (their
        load on shared cores; ignored on clusters with a device per rank)."""
        return sim.resource(name, policy, load=float(ranks) if self.cluster.shared_cores else 0)

    def link(self, sim: Simulation, name: str = "link") -> str:
        """Declare the resource collectives run on. On shared cores (this machine) a
        collective is the ranks' own CPU work (copies, the progress threads, waiting for
        each other) and keeps as many cores busy as it has ranks, at most all of them: its
        calibrated time already includes more ranks than cores sharing them. Compute that
        overlaps it (ZeRO-3's prefetched gathers) slows down, and so does the collective."""
        cores = self.cluster.shared_cores
        return sim.resource(name, "fifo", load=float(min(self.workers, cores)) if cores else 0.0)

    @property
    def layers(self) -> int:
        return len(self.profile.layers)

    @property
    def global_batch(self) -> int:
        return self.workload.batch(self.workers)

    def forward(self, layer: int, batch: float, factor: float = 1.0) -> float:
        return self.profile.layers[layer].forward(batch) * self.scale * factor

    def backward(self, layer: int, batch: float, factor: float = 1.0) -> float:
        return self.profile.layers[layer].backward(batch) * self.scale * factor

    def optimizer(self, params: float, tensors: int = 1) -> float:
        """The workload's optimizer over ``params`` parameters in ``tensors`` tensors."""
        return self.profile.optimizer(params, self.workload.optimizer, tensors) * self.scale

    def grad_bytes(self, layers: range | list[int] | None = None) -> float:
        chosen = range(self.layers) if layers is None else layers
        return sum(self.profile.layers[i].params for i in chosen) * self.workload.element_bytes

    def ideal_s(self) -> float:
        """One device processing its 1/W share of the global batch with no communication,
        no bubble and no straggler: the numerator of scaling efficiency (Horovod's: the
        throughput of W workers over W times one worker's). That device steps the optimizer
        over the whole model (:meth:`whole_optimizer_s`), so a strategy whose ranks each
        step a shard of it can beat it (:func:`explain_efficiency`)."""
        one = Case(self.profile, self.cluster, self.workload, 1)
        batch = self.global_batch / self.workers
        return (self.profile.compute(batch) + self.profile.optimizer(
            self.profile.params, self.workload.optimizer, self.profile.tensors)) * one.scale \
            + self.overheads.step_s

    def whole_optimizer_s(self) -> float:
        """The optimizer step over the whole model on one device, as :meth:`ideal_s`
        charges it."""
        one = Case(self.profile, self.cluster, self.workload, 1)
        return self.profile.optimizer(self.profile.params, self.workload.optimizer,
                                      self.profile.tensors) * one.scale

    def group(self, size: int, stride: int = 1) -> Group:
        return group_of(self.cluster, size, stride)

    def collective(self, op: str, group: Group, nbytes: float) -> tuple[float, float, str]:
        """(seconds, bytes the busiest device sends, algorithm) for one collective."""
        seconds, algorithm = collective_time(self.cluster, op, self.workload.algorithm, group,
                                             nbytes)
        return seconds, bytes_sent(op, algorithm, group, nbytes), algorithm


@dataclass(frozen=True)
class StepResult:
    """One simulated training step of a strategy at a number of workers."""

    strategy: str
    workers: int
    global_batch: int
    step_s: float = float("nan")
    ideal_s: float = float("nan")
    memory_bytes: float = 0.0  # peak per device, max over devices
    bytes_sent: float = 0.0  # per device per step, max over devices
    device_memory: float = 0.0
    notes: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the strategy cannot run this case at all (not memory)

    @property
    def fits(self) -> bool:
        return self.error is None and self.memory_bytes <= self.device_memory

    @property
    def efficiency(self) -> float:
        return self.ideal_s / self.step_s if self.error is None and self.step_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_s if self.error is None and self.step_s > 0 \
            else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "workers": self.workers,
                "global_batch": self.global_batch,
                "step_s": None if self.error else self.step_s,
                "samples_per_s": self.samples_per_s or None,
                "efficiency": self.efficiency or None, "memory_bytes": self.memory_bytes,
                "device_memory": self.device_memory, "fits": self.fits,
                "bytes_sent": self.bytes_sent, "notes": list(self.notes),
                "details": self.details, "error": self.error}


def not_applicable(case: Case, strategy: str, why: str) -> StepResult:
    return StepResult(strategy, case.workers, case.global_batch,
                      device_memory=case.cluster.device_memory, error=why)


def explain_efficiency(case: Case, result: StepResult) -> StepResult:
    """``result`` with a note saying why, when its scaling efficiency is above 100 %.

    The ideal step (:meth:`Case.ideal_s`) is one device's, and one device steps the
    optimizer over the whole model. A strategy whose ranks each step a shard of it (ZeRO's
    1/N, a pipeline stage's layers, a tensor-parallel rank's 1/t, a parameter server's
    share) saves the rest, and when it hides its communication it beats the ideal by up to
    that saving: ResNet-101 under ZeRO-3 on 8 of cluster-400g's GPUs steps 1/8 of the
    optimizer's 1.27 ms and runs at 110 %. That is what real sharding does, so the row
    keeps its number and says so. A row above 100 % by more than its optimizer saves would
    be an error of the model, and says that instead. The strategies record their rank's
    optimizer seconds as ``details["optimizer_s"]``."""
    if result.efficiency <= 1.0:
        return result
    whole, own = case.whole_optimizer_s(), result.details.get("optimizer_s")
    if own is not None and result.ideal_s - result.step_s <= whole - own + 1e-9 * result.ideal_s:
        note = (f"over 100%: its optimizer steps a shard, {own * 1e3:.3g} ms vs the 1-worker "
                f"baseline's {whole * 1e3:.3g} ms")
    else:
        note = ("over 100% and not by a sharded optimizer: a simulator error, please report "
                "it with this command")
    return replace(result, notes=(*result.notes, note))
