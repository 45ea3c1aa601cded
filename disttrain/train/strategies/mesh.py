"""The settings of a mesh run (``tp``, ``tp-sp``, ``3d``), read from the config and the world
size, and the checks that can refuse a bad mesh before any rank starts.

Both mesh strategies read these settings: :mod:`.tensor` (pp = 1) and :mod:`.tensor_pipeline`
(pp > 1); keeping them here lets the one build the other without either importing the
other back.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.parallel.mesh import MeshShape
from disttrain.parallel.tensor.transformer import lm_shape
from disttrain.train.config import TrainConfig
from disttrain.train.strategies.pipeline import DEFAULT_MICROBATCHES

TP_ONLY = ("tp", "tp-sp")


@dataclass(frozen=True)
class MeshSettings:
    """How a mesh strategy runs, read from the config and the world size."""

    shape: MeshShape
    sequence_parallel: bool
    zero: int | None
    algorithm: str | None


def mesh_settings(config: TrainConfig, world_size: int) -> MeshSettings:
    opts = config.parallel
    if config.strategy in TP_ONLY or config.strategy.startswith("torch-tp"):
        shape = MeshShape(tp=world_size)
    else:
        shape = MeshShape.infer(world_size, opts.dp_size, opts.pp_size, opts.tp_size)
    sp = opts.sequence_parallel or config.strategy.endswith("-sp")
    return MeshSettings(shape, sp, opts.zero, opts.algorithm)


def mesh_workload(config: TrainConfig, world_size: int) -> str | None:
    """Collectives only without pipeline stages; with them, the stages' messages say p2p."""
    return "collectives" if mesh_settings(config, world_size).shape.pp == 1 else None


def check_mesh(config: TrainConfig, world_size: int, dp: int) -> None:
    """What can be checked before any rank starts: the model, its sizes, the mesh's."""
    from disttrain.parallel.tensor.transformer import check_divisible, check_sequence
    from disttrain.train.data import build_dataset
    from disttrain.train.models import MODELS, TRANSFORMER_MODELS, build_model

    name, opts = config.strategy, config.parallel
    settings = mesh_settings(config, world_size)
    shape, tp = settings.shape, settings.shape.tp
    if config.model in MODELS and config.model not in TRANSFORMER_MODELS:
        raise ValueError(f"strategy {name!r} splits a transformer's attention heads, MLP and "
                         f"vocabulary; model {config.model!r} is not a TransformerLM: use "
                         f"--model transformer --dataset synthetic-lm")
    if config.model in TRANSFORMER_MODELS and tp > 1:
        model = build_model(config.model, build_dataset(config.dataset, config.data).info)
        check_divisible(model, tp)
        if settings.sequence_parallel:
            check_sequence(lm_shape(model)["max_len"], tp)
    if settings.zero is not None:
        if shape.dp == 1 or shape.pp > 1:
            raise ValueError(f"--zero {settings.zero} shards over the dp groups of a mesh with "
                             f"pp = 1; this mesh has dp {shape.dp}, pp {shape.pp}: use --dp ≥ 2 "
                             f"and --pp 1, or drop --zero")
        if settings.zero == 2 and settings.sequence_parallel:
            raise ValueError("--zero 2 drops each gradient once it is reduce-scattered over "
                             "dp, before sequence parallelism sums its LayerNorm gradients "
                             "over tp: use --zero 1 with --sequence-parallel")
        if config.checkpoint_dir is not None:
            raise ValueError("checkpoints of ZeRO inside a mesh are not written yet; drop "
                             "--checkpoint-dir or --zero")
    if shape.pp > 1:
        if config.accumulate != 1:
            raise ValueError(f"strategy {name!r} with --pp {shape.pp} runs each step as one "
                             f"batch through its stages; --accumulate must be 1 (pipelines "
                             f"split batches with --microbatches)")
        if opts.partition == "time":
            raise ValueError("--partition time times layers alone, but a TP shard's layers "
                             "communicate: use params or layer counts per stage")
        m = opts.microbatches or DEFAULT_MICROBATCHES
        if config.global_batch // dp < m:
            raise ValueError(f"global batch {config.global_batch} gives each of the {dp} "
                             f"replica(s) {config.global_batch // dp} samples, fewer than {m} "
                             f"micro-batches; use --microbatches {config.global_batch // dp} "
                             f"or less, or a larger --global-batch")
    elif opts.microbatches is not None or opts.schedule is not None or (
            opts.partition is not None):
        raise ValueError("--microbatches, --schedule and --partition apply to the pipeline "
                         "dimension: give --pp ≥ 2 with them")
