"""disttrain.parallel: training strategies built on the Communicator, one folder each, whose
entry file maps the rest: :mod:`.ddp` (data parallel, gradient compression),
:mod:`.pipeline` (pipeline and plain model parallel), :mod:`.tensor` (tensor and sequence
parallel), :mod:`.zero` and :mod:`.parameter_server`; and what several share: the
dp × pp × tp device mesh (:mod:`.mesh`), loss scaling and autocast
(:mod:`.mixed_precision`), sealed checkpoint files (:mod:`.checkpoint_files`)."""

from disttrain.parallel.ddp import DataParallel, DataParallelConfig
from disttrain.parallel.ddp.buckets import Bucket, plan_buckets
from disttrain.parallel.ddp.compression import (
    COMPRESSORS,
    CastCompressor,
    Compressor,
    NoCompression,
    PowerSGDCompressor,
    TopKCompressor,
    make_compressor,
)
from disttrain.parallel.ddp.reducer import OverlapReport, SyncTiming, UnusedParametersError
from disttrain.parallel.mesh import DeviceMesh, MeshCoords, MeshShape, build_mesh
from disttrain.parallel.mixed_precision import LossScaler, LossScalerConfig, autocast
from disttrain.parallel.parameter_server import (
    PSConfig,
    PSWorker,
    assign_roles,
    run_parameter_server,
)
from disttrain.parallel.pipeline import (
    SCHEDULES,
    PipelineConfig,
    PipelineError,
    PipelineParallel,
    StageFailedError,
    build_pipeline,
    format_schedule,
    gpipe,
    one_f_one_b,
    simulate,
)
from disttrain.parallel.pipeline.model_parallel import build_model_parallel
from disttrain.parallel.zero import STAGES as ZERO_STAGES
from disttrain.parallel.zero import ZeRO1, ZeRO2, ZeRO3, ZeroConfig

__all__ = [
    "COMPRESSORS",
    "SCHEDULES",
    "ZERO_STAGES",
    "Bucket",
    "CastCompressor",
    "Compressor",
    "DataParallel",
    "DataParallelConfig",
    "DeviceMesh",
    "LossScaler",
    "LossScalerConfig",
    "MeshCoords",
    "MeshShape",
    "NoCompression",
    "OverlapReport",
    "PSConfig",
    "PSWorker",
    "PipelineConfig",
    "PipelineError",
    "PipelineParallel",
    "PowerSGDCompressor",
    "StageFailedError",
    "SyncTiming",
    "TopKCompressor",
    "UnusedParametersError",
    "ZeRO1",
    "ZeRO2",
    "ZeRO3",
    "ZeroConfig",
    "assign_roles",
    "autocast",
    "build_mesh",
    "build_model_parallel",
    "build_pipeline",
    "format_schedule",
    "gpipe",
    "make_compressor",
    "one_f_one_b",
    "plan_buckets",
    "run_parameter_server",
    "simulate",
]


def __getattr__(name: str) -> object:
    if name == "ModelParallel":  # deprecated: the pipeline engine with one micro-batch
        from disttrain.parallel.pipeline import model_parallel

        return getattr(model_parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
