"""The composer: every preset of :mod:`disttrain.parallel.presets` (``ddp``, ``zero1-3``,
``model-parallel``, ``gpipe``, ``1f1b``, ``tp``, ``tp-sp``, ``3d``, ``cp``, ``ep``) built the
same way, its
dimensions applied in one order a reader can follow (as torchtitan's ``parallelize``
functions read)::

    mesh    = build_mesh(comm, the preset's degrees)        dp × pp × cp × ep × tp
    model   = tensor/sequence parallel shard over mesh.tp     1. tp > 1
    experts = this rank's experts over mesh.ep, DDP over dp  2. ep > 1
    stages  = pipeline of the (sharded) model over mesh.pp    3. a schedule: stages average
                                                                 their gradients over dp
    context = the (sharded) model's attention over mesh.cp    4. cp > 1, or tp > 1: the
    replica   and DDP or ZeRO-1/2 over mesh.dp                   shard over cp, then dp
    replica = DDP, or ZeRO-1/2/3, over mesh.dp                4. otherwise

Each result is a :class:`~disttrain.train.strategies.base.Strategy` the shared loop drives:
:class:`~.data_parallel.DataParallelStrategy`, :class:`~.zero.ZeroStrategy`,
:class:`~.pipeline.PipelineStrategy`, :class:`~.tensor.TensorParallelStrategy` or
:class:`~.tensor_pipeline.TensorPipelineStrategy`, by the dimensions it spans. Adding a
dimension is a step here (see docs/extending.md).
"""

from __future__ import annotations

import dataclasses

from disttrain.parallel.mesh import DeviceMesh, build_mesh
from disttrain.parallel.presets import get_preset
from disttrain.parallel.tensor import Parallelized, apply_tensor_parallel, parallelize
from disttrain.parallel.tensor.transformer import TensorParallelLM
from disttrain.train.strategies.base import BuildContext, Strategy
from disttrain.train.strategies.mesh import MeshSettings, mesh_settings


def compose(ctx: BuildContext) -> Strategy:
    """The strategy ``ctx.config.strategy`` names, on one mesh over ``ctx.comm``."""
    config = ctx.config
    comm = ctx.require_comm(config.strategy)
    settings = mesh_settings(config, comm.world_size)
    mesh = build_mesh(comm, settings.shape)
    shard = tensor_parallel(ctx, mesh, settings)  # 1.
    if mesh.size("ep") > 1:  # 2. (expert parallelism carries its data parallelism along)
        from disttrain.train.strategies.experts import ExpertParallelStrategy

        return ExpertParallelStrategy(ctx, mesh, settings)
    if settings.schedule is not None and mesh.pp_size > 1:  # 3.
        return pipeline(ctx, mesh, settings, shard)
    if isinstance(shard, Parallelized):  # a Hugging Face model's shard (strategies/hf.py)
        from disttrain.train.strategies.hf import HFTensorParallelStrategy

        return HFTensorParallelStrategy(ctx, mesh, settings, shard)  # 4., on the shard
    if shard is not None or mesh.cp is not None:
        from disttrain.train.strategies.tensor import TensorParallelStrategy

        return TensorParallelStrategy(ctx, mesh, settings, shard)  # 4., on the shard / cp
    return data_parallel(ctx, mesh, settings)  # 4.


def tensor_parallel(ctx: BuildContext, mesh: DeviceMesh, settings: MeshSettings
                    ) -> TensorParallelLM | Parallelized | None:
    """1. This rank's tensor-parallel shard of the model (None when tp = 1): disttrain's
    TransformerLM as a :class:`TensorParallelLM`, any other model by its built-in plan
    (Hugging Face GPT-2 and Llama: :func:`~disttrain.parallel.tensor.parallelize`)."""
    if mesh.tp is None:
        return None
    if getattr(ctx.module, "config", None) is not None:  # a transformers model
        return parallelize(ctx.module, mesh.tp, sequence_parallel=settings.sequence_parallel,
                           algorithm=settings.algorithm)
    return apply_tensor_parallel(ctx.module, mesh.tp, settings.sequence_parallel,
                                 settings.algorithm)


def pipeline(ctx: BuildContext, mesh: DeviceMesh, settings: MeshSettings,
             shard: TensorParallelLM | Parallelized | None) -> Strategy:
    """3. This rank's stage of the (sharded) model; the stages of one pp position average
    their gradients over dp (the pipeline engine's own all-reduce). A Hugging Face model
    is cut as its chain of stage functions (:func:`~.hf.pipeline_view`)."""
    from disttrain.parallel.pipeline import build_pipeline
    from disttrain.train.strategies.pipeline import PipelineSettings, PipelineStrategy
    from disttrain.train.strategies.tensor_pipeline import TensorPipelineStrategy

    assert settings.schedule is not None
    if isinstance(shard, Parallelized):
        from disttrain.train.strategies.hf import HFTensorPipelineStrategy

        return HFTensorPipelineStrategy(ctx, mesh, settings, shard)
    if shard is not None:
        return TensorPipelineStrategy(ctx, mesh, settings, shard)
    from disttrain.parallel.pipeline import bundle
    from disttrain.train.strategies.hf import pipeline_view

    ctx = dataclasses.replace(ctx, module=pipeline_view(ctx.module))
    partition = ctx.config.parallel.partition or "params"
    m, inputs = settings.microbatches, ctx.sample[0]
    v = ctx.config.parallel.virtual_stages or 1  # chunks per stage: interleaved 1F1B
    pipe = build_pipeline(ctx.module, mesh.world, schedule=settings.schedule,
                          microbatches=m, partition=partition, mesh=mesh,
                          sample=bundle.split(inputs, m)[0],  # one micro-batch
                          warn_bubble=not settings.model_parallel, virtual_stages=v)
    label = None if settings.model_parallel else settings.schedule
    return PipelineStrategy(ctx, pipe, PipelineSettings(label, m, mesh.pp_rank, mesh.pp_size,
                                                        mesh.dp_rank, mesh.dp_size, v))


def data_parallel(ctx: BuildContext, mesh: DeviceMesh, settings: MeshSettings) -> Strategy:
    """4. DDP (replicated model state) or ZeRO stage 1-3 (sharded) over the dp ranks."""
    from disttrain.train.strategies.data_parallel import build_ddp
    from disttrain.train.strategies.zero import ZeroStrategy

    comm = mesh.dp if mesh.dp is not None else mesh.world
    if settings.zero:
        if mesh.size("dp_shard") > 1 and mesh.size("dp_replicate") > 1:  # hybrid sharding
            from disttrain.parallel.zero import zero_groups

            shard, replicate = zero_groups(mesh)
            return ZeroStrategy(ctx, settings.zero, shard, replicate=replicate)
        return ZeroStrategy(ctx, settings.zero, comm)
    return build_ddp(ctx, comm)


def preset_kind(name: str) -> str:
    """How a preset's ranks divide the data (its layout): data, pipeline, model, mesh."""
    return get_preset(name).kind
