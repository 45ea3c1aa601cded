"""The settings of a composed run (every preset but ``single`` and the parameter servers),
read from its preset (:mod:`disttrain.parallel.presets`), the config's flags and the world
size, and the checks that can refuse a bad mesh before any rank starts.

The composer (:mod:`.compose`) and the strategies it builds read these settings; keeping
them here lets them build each other without either importing the other back.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.parallel.mesh import MeshShape
from disttrain.parallel.presets import PRESETS, degrees, get_preset
from disttrain.parallel.tensor.transformer import lm_shape
from disttrain.train.config import TrainConfig
from disttrain.train.strategies.pipeline import DEFAULT_MICROBATCHES


@dataclass(frozen=True)
class MeshSettings:
    """How a composed strategy runs, read from its preset, the flags and the world size."""

    shape: MeshShape
    sequence_parallel: bool
    zero: int | None  # ZeRO stage over dp (None or 0: DDP)
    algorithm: str | None
    schedule: str | None = None  # the pipeline's, when pp > 1
    microbatches: int = DEFAULT_MICROBATCHES
    model_parallel: bool = False  # a pipeline of one micro-batch, by design
    cp_variant: str = "ring"  # context parallelism's attention: "ring" or "ulysses"


def mesh_settings(config: TrainConfig, world_size: int) -> MeshSettings:
    """The settings of ``config.strategy`` (a preset; the tensor-parallel baselines read
    the tp preset of the same name) on ``world_size`` ranks."""
    opts, name = config.parallel, config.strategy
    preset = get_preset(name if name in PRESETS else name.removeprefix("torch-"))
    sizes = degrees(preset, world_size, dp=opts.dp_size, pp=opts.pp_size, tp=opts.tp_size,
                    cp=opts.cp_size, ep=opts.ep_size)
    replicate, shard = dp_split(sizes["dp"], opts.dp_shard, opts.dp_replicate)
    shape = MeshShape(dp_replicate=replicate, dp_shard=shard, pp=sizes["pp"], tp=sizes["tp"],
                      cp=sizes["cp"], ep=sizes["ep"])
    sp = opts.sequence_parallel or preset.sequence_parallel
    zero = opts.zero if opts.zero is not None else (preset.zero or None)
    schedule = opts.schedule or preset.schedule
    m = preset.microbatches or opts.microbatches or DEFAULT_MICROBATCHES
    return MeshSettings(shape, sp, zero, opts.algorithm, schedule, m,
                        model_parallel=preset.microbatches == 1, cp_variant=opts.cp_variant)


def dp_split(dp: int, shard: int | None, replicate: int | None) -> tuple[int, int]:
    """(dp_replicate, dp_shard) of ``dp`` data-parallel ranks: hybrid sharding when
    ``--dp-shard`` or ``--dp-replicate`` is given (the other one takes the rest), else all
    of dp unsplit; sizes that do not multiply to dp are a one-line ValueError."""
    if shard is None and replicate is None:
        return dp, 1
    if shard is None:
        assert replicate is not None
        shard = dp // replicate if dp % replicate == 0 else 0
    if replicate is None:
        replicate = dp // shard if dp % shard == 0 else 0
    if shard == 1 and dp > 1:
        raise ValueError("--dp-shard 1 shards nothing (every rank a replica): use --strategy "
                         "ddp, or a --dp-shard of 2 or more")
    if shard * replicate != dp:
        raise ValueError(f"--dp-shard × --dp-replicate must equal the {dp} data-parallel "
                         f"ranks; got shard {shard or '?'} × replicate {replicate or '?'}: "
                         f"choose sizes whose product is {dp}")
    return replicate, shard


def mesh_workload(config: TrainConfig, world_size: int) -> str | None:
    """Collectives only without pipeline stages; with them, the stages' messages say p2p."""
    return "collectives" if mesh_settings(config, world_size).shape.pp == 1 else None


def check_mesh(config: TrainConfig, world_size: int, dp: int) -> None:
    """What can be checked before any rank starts: the model, its sizes, the mesh's."""
    from disttrain.parallel.tensor.transformer import check_divisible, check_sequence
    from disttrain.train.data import build_dataset
    from disttrain.train.models import MODELS, TRANSFORMER_MODELS, build_model, is_hf_model

    name, opts = config.strategy, config.parallel
    settings = mesh_settings(config, world_size)
    shape, tp = settings.shape, settings.shape.tp
    if shape.size("cp") > 1:
        _check_context(config, settings)
    if shape.size("ep") > 1:
        _check_experts(config, shape.size("ep"))
    elif config.model in MODELS and config.model not in TRANSFORMER_MODELS:
        raise ValueError(f"strategy {name!r} splits a transformer's attention heads, MLP and "
                         f"vocabulary; model {config.model!r} is not a TransformerLM: use "
                         f"--model transformer --dataset synthetic-lm")
    if is_hf_model(config.model) and shape.size(("tp", "pp")) > 1:
        from disttrain.train.strategies.hf_checks import check_hf_mesh

        check_hf_mesh(config, shape.tp, settings.zero, settings.sequence_parallel)
    if config.model in TRANSFORMER_MODELS and tp > 1:
        model = build_model(config.model, build_dataset(config.dataset, config.data).info,
                            config.model_config)
        check_divisible(model, tp)
        if settings.sequence_parallel:
            check_sequence(lm_shape(model)["max_len"], tp)
    if settings.zero is not None:
        if shape.dp == 1 or shape.pp > 1:
            raise ValueError(f"--zero {settings.zero} shards over the dp groups of a mesh with "
                             f"pp = 1; this mesh has dp {shape.dp}, pp {shape.pp}: use --dp ≥ 2 "
                             f"and --pp 1, or drop --zero")
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


def _check_experts(config: TrainConfig, ep: int) -> None:
    """Expert parallelism needs mixture-of-experts layers whose experts divide over ep."""
    from disttrain.train.data import build_dataset
    from disttrain.train.models import build_model
    from disttrain.train.moe import moe_layers

    model = build_model(config.model, build_dataset(config.dataset, config.data).info,
                        config.model_config)
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"strategy {config.strategy!r} spreads the experts of mixture-of-"
                         f"experts layers; model {config.model!r} has none: use --model "
                         f"transformer-moe --dataset synthetic-lm")
    experts = {layer.experts.n_experts for layer in layers}
    if any(n % ep for n in experts):
        raise ValueError(f"{sorted(experts)} experts per layer do not divide over --ep {ep}; "
                         f"choose an --ep that divides them")


def _check_context(config: TrainConfig, settings: MeshSettings) -> None:
    """Context parallelism splits the TransformerLM's sequences into 2·cp chunks; Ulysses
    splits this rank's heads over cp; it does not run inside pipeline stages or beside
    ZeRO-2 or 3 (which drop gradients before cp sums them)."""
    from disttrain.parallel.context import check_sequence
    from disttrain.parallel.context.api import lm_layers
    from disttrain.train.data import build_dataset
    from disttrain.train.models import build_model

    shape, cp = settings.shape, settings.shape.size("cp")
    model = build_model(config.model, build_dataset(config.dataset, config.data).info,
                        config.model_config)
    lm_layers(model)  # a TransformerLM (or one shaped like it), else a one-line error
    if shape.pp > 1:
        raise ValueError(f"--cp {cp} inside pipeline stages is not built yet; use --pp 1 "
                         f"with --cp")
    if settings.zero in (2, 3):
        raise ValueError(f"--zero {settings.zero} drops each gradient once it is reduce-"
                         f"scattered over dp, before context parallelism sums it over cp: use "
                         f"--zero 1 with --cp")
    check_sequence(config.data.seq_len, cp)
    if settings.cp_variant == "ulysses":
        heads = lm_shape(model)["n_heads"] // shape.tp
        if heads % cp:
            raise ValueError(f"Ulysses splits the {heads} attention heads of each tp rank "
                             f"over --cp {cp}, which does not divide them; use --cp-variant "
                             f"ring or a --cp that divides {heads}")
