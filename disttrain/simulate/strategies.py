"""The simulated strategies by name, and the sweep over worker counts.

Each preset of :mod:`disttrain.parallel.presets` (the names of ``disttrain run --strategy``)
is simulated from its dimensions and options, not its name: data parallelism with its ZeRO
stage, a pipeline with its schedule and micro-batches, tensor parallelism over every
worker or inside a node, the parameter servers in their mode. A strategy that cannot run a
case at all (more stages than layers, a pp size that does not divide the workers) returns
a row with ``error`` set; one that runs but does not fit in memory is simulated anyway and
marked by ``fits``.
"""

from __future__ import annotations

from collections.abc import Callable

from disttrain.parallel.presets import ALL, FLAG_OR_ALL, PRESETS, Preset
from disttrain.simulate.base import Case, StepResult, explain_efficiency
from disttrain.simulate.cluster import Cluster
from disttrain.simulate.context_experts import simulate_cp, simulate_ep
from disttrain.simulate.data_parallel import simulate_data_parallel
from disttrain.simulate.parameter_server import simulate_ps
from disttrain.simulate.pipeline import simulate_pipeline
from disttrain.simulate.profile import ModelProfile
from disttrain.simulate.tensor_parallel import simulate_tp
from disttrain.simulate.workload import Workload

Simulator = Callable[[Case], StepResult]


def simulator_for(name: str, preset: Preset) -> Simulator | None:
    """The model of preset ``name``'s step, chosen by its dimensions and options; None for
    the one-process reference (nothing to simulate)."""
    if preset.reference:
        return None
    if preset.parameter_server is not None:
        mode = preset.parameter_server
        return lambda case: simulate_ps(case, mode)
    rules = dict(preset.dims)
    if rules.get("cp") == FLAG_OR_ALL:  # the cp preset (3d simulates its tp × pp × dp)
        return lambda case: simulate_cp(case, name)
    if rules.get("ep") == FLAG_OR_ALL:
        return lambda case: simulate_ep(case, name)
    if preset.kind == "mesh":
        return lambda case: simulate_tp(case, name, sequence_parallel=preset.sequence_parallel,
                                        tp_everywhere=rules.get("tp") == ALL)
    if preset.kind in ("pipeline", "model"):
        return lambda case: simulate_pipeline(case, name, schedule=preset.schedule,
                                              microbatches=preset.microbatches,
                                              every_rank=rules.get("pp") == ALL)
    return lambda case: simulate_data_parallel(case, name, preset.zero)


STRATEGIES: dict[str, Simulator] = {
    name: sim for name, preset in PRESETS.items()
    if (sim := simulator_for(name, preset)) is not None}


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
