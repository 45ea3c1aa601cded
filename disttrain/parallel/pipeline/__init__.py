"""Pipeline parallelism: a sequential model split into stages over ranks, each batch cut into
micro-batches that flow through the stages under a schedule (GPipe, 1F1B, or interleaved
1F1B over v virtual stages per rank).

* :mod:`.partition`: which layers go to which stage (explicit, by parameters, by time);
* :mod:`.schedules`: each stage's ordered actions as pure data (GPipe, 1F1B, and interleaved
  1F1B with v chunks per rank); :mod:`.schedule_check` checks a schedule on paper and
  prints it as a grid;
* :mod:`.runtime`: :class:`PipelineParallel`, this rank's stage (its v chunks, interleaved)
  executing its schedule; :mod:`.config`: its settings and step statistics; :mod:`.stage`:
  a stage's compute and its stash of micro-batches; :mod:`.step`: the interpreter of one
  step's actions;
  :mod:`.link` and :mod:`.wire`: the messages between neighbouring stages (a chain, or a
  ring when interleaved) and their header; :mod:`.collectives`: what the
  stages agree on and average over the mesh (pipelines × data-parallel replicas:
  :mod:`disttrain.parallel.mesh`);
* :mod:`.model_parallel`: the plain split (no micro-batches): a pipeline of one micro-batch.

See docs/pipeline.md.
"""

from disttrain.parallel.pipeline.config import PipelineConfig, PipelineTotals, StepStats
from disttrain.parallel.pipeline.link import PipelineError, StageFailedError
from disttrain.parallel.pipeline.model_parallel import build_model_parallel
from disttrain.parallel.pipeline.partition import (
    PartitionError,
    balance_by_cost,
    layers_of,
    param_costs,
    time_costs,
)
from disttrain.parallel.pipeline.runtime import PipelineParallel, build_pipeline
from disttrain.parallel.pipeline.schedule_check import (
    ScheduleError,
    SimResult,
    format_schedule,
    simulate,
)
from disttrain.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Backward,
    Forward,
    InterleavedSchedule,
    InterleavedScheduleError,
    RecvAct,
    RecvGrad,
    Schedule,
    SendAct,
    SendGrad,
    get_schedule,
    gpipe,
    interleaved,
    interleaved_1f1b,
    one_f_one_b,
    simulate_interleaved,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "Backward",
    "Forward",
    "InterleavedSchedule",
    "InterleavedScheduleError",
    "PartitionError",
    "PipelineConfig",
    "PipelineError",
    "PipelineParallel",
    "PipelineTotals",
    "RecvAct",
    "RecvGrad",
    "Schedule",
    "ScheduleError",
    "SendAct",
    "SendGrad",
    "SimResult",
    "StageFailedError",
    "StepStats",
    "balance_by_cost",
    "build_model_parallel",
    "build_pipeline",
    "format_schedule",
    "get_schedule",
    "gpipe",
    "interleaved",
    "interleaved_1f1b",
    "layers_of",
    "one_f_one_b",
    "param_costs",
    "simulate",
    "simulate_interleaved",
    "time_costs",
]


def __getattr__(name: str) -> object:
    if name == "ModelParallel":  # deprecated: the pipeline engine with one micro-batch
        from disttrain.parallel.pipeline import model_parallel

        return getattr(model_parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
