"""Pipeline parallelism: a sequential model split into stages over ranks, each batch cut into
micro-batches that flow through the stages under a schedule (GPipe or 1F1B).

* :mod:`.partition`: which layers go to which stage (explicit, by parameters, by time);
* :mod:`.schedules`: each stage's ordered actions, pure data; :mod:`.schedule_check` checks them
  and prints them as a grid; :mod:`.interleaved`: interleaved 1F1B (v chunks per rank),
  data and paper simulation only;
* :mod:`.link`, :mod:`.stage`, :mod:`.step`, :mod:`.runtime`: the engine that executes a
  schedule over :mod:`disttrain.comm`; :mod:`.collectives`: what the stages agree on and
  average over the mesh (pipelines × data-parallel replicas: :mod:`disttrain.parallel.mesh`).

See docs/pipeline.md.
"""

from disttrain.parallel.pipeline.config import PipelineConfig, PipelineTotals, StepStats
from disttrain.parallel.pipeline.interleaved import (
    InterleavedSchedule,
    InterleavedScheduleError,
    interleaved_1f1b,
    simulate_interleaved,
)
from disttrain.parallel.pipeline.link import PipelineError, StageFailedError
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
    RecvAct,
    RecvGrad,
    Schedule,
    SendAct,
    SendGrad,
    get_schedule,
    gpipe,
    one_f_one_b,
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
    "build_pipeline",
    "format_schedule",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "layers_of",
    "one_f_one_b",
    "param_costs",
    "simulate",
    "simulate_interleaved",
    "time_costs",
]
