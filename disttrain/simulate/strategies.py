"""The simulated strategies by name, and the sweep over worker counts.

Names follow ``disttrain run --strategy`` (and the reserved ``ps-*`` names of the
parameter-server strategies). A strategy that cannot run a case at all (more stages than
layers, a pp size that does not divide the workers) returns a row with ``error`` set;
one that runs but does not fit in memory is simulated anyway and marked by ``fits``.
"""

from __future__ import annotations

from collections.abc import Callable

from disttrain.simulate.base import Case, StepResult, explain_efficiency
from disttrain.simulate.cluster import Cluster
from disttrain.simulate.data_parallel import simulate_ddp, simulate_zero3, simulate_zero12
from disttrain.simulate.parameter_server import simulate_ps
from disttrain.simulate.pipeline import simulate_pipeline
from disttrain.simulate.profile import ModelProfile
from disttrain.simulate.tensor_parallel import simulate_tp
from disttrain.simulate.workload import Workload

Simulator = Callable[[Case], StepResult]

STRATEGIES: dict[str, Simulator] = {
    "ddp": simulate_ddp,
    "zero1": lambda case: simulate_zero12(case, 1),
    "zero2": lambda case: simulate_zero12(case, 2),
    "zero3": simulate_zero3,
    "ps-sync": lambda case: simulate_ps(case, "sync"),
    "ps-async": lambda case: simulate_ps(case, "async"),
    "ps-ssp": lambda case: simulate_ps(case, "ssp"),
    "model-parallel": lambda case: simulate_pipeline(case, "model-parallel"),
    "gpipe": lambda case: simulate_pipeline(case, "gpipe"),
    "1f1b": lambda case: simulate_pipeline(case, "1f1b"),
    "tp": lambda case: simulate_tp(case, "tp"),
    "tp-sp": lambda case: simulate_tp(case, "tp-sp"),
    "3d": lambda case: simulate_tp(case, "3d"),
}


def check_names(names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategy {', '.join(unknown)}; simulated: "
                         f"{', '.join(STRATEGIES)}")


def simulate(profile: ModelProfile, cluster: Cluster, workload: Workload, strategy: str,
             workers: int) -> StepResult:
    """One strategy at one worker count. A cluster with fewer devices than ``workers`` is
    extended by nodes of the same kind, and the row says so."""
    check_names((strategy,))
    fitted = cluster.fitted(workers)
    case = Case(profile, fitted, workload, workers)
    result = explain_efficiency(case, STRATEGIES[strategy](case))
    if fitted is not cluster:
        note = f"assumes {fitted.nodes} nodes (cluster has {cluster.nodes})"
        result = StepResult(**{**result.__dict__, "notes": (*result.notes, note)})
    return result


def sweep(profile: ModelProfile, cluster: Cluster, workload: Workload,
          strategies: tuple[str, ...], workers: tuple[int, ...]) -> list[StepResult]:
    """Every strategy at every worker count, in table order (by strategy, then workers)."""
    check_names(strategies)
    return [simulate(profile, cluster, workload, s, w) for s in strategies for w in workers]
