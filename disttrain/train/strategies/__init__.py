"""Strategies: how one training step runs on a communicator. A registry of name → spec.

Adding a strategy is one entry in :data:`PRESETS`: a builder ``(BuildContext) →
Strategy``, a description, the :class:`~disttrain.train.config.ParallelOptions` fields it
accepts, and how its ranks divide the data (its *layout*)::

    "single"          one process, the reference every other strategy must match
    "ddp"             disttrain.parallel.DataParallel: bucketed all-reduce over disttrain.comm
    "zero1/2/3"       disttrain.parallel.zero: sharded optimizer state / + gradients / + params
    "model-parallel"  consecutive layers on consecutive ranks, one batch at a time
    "gpipe", "1f1b"   disttrain.parallel.pipeline with that schedule (pp × dp with pp_size)
    "ps-sync"         parameter server (disttrain.parallel.parameter_server), synchronous SGD
    "ps-async"        parameter server, asynchronous SGD (updates applied on arrival)
    "ps-ssp"          parameter server, stale-synchronous: at most --staleness steps ahead
    "tp", "tp-sp"     disttrain.parallel.tensor over every rank (tp-sp: sequence parallel)
    "3d"              dp × pp × tp on one mesh (--dp, --pp, --tp; --zero 1/2/3 over dp)
    ("pipeline" is accepted as the strategy name: it means parallel.schedule, 1f1b by default)

:data:`STRATEGIES` adds the baselines (``torch-ddp``, ``torch-fsdp``, ``deepspeed-zero2``, …:
PyTorch's and DeepSpeed's own implementations, disttrain/baselines/) to these names; the
baselines' package is loaded only when one of its names is asked for.

Layouts: ``data`` (every rank a replica reading its own shard), ``pipeline`` (world/pp_size
replicas of a pp_size-stage pipeline; every stage of a replica reads the same shard),
``model`` (one model split over every rank, one shard), ``ps`` (the first world − servers
ranks are data-parallel workers, the last ``servers`` ranks hold the parameters: ``-n W``
means W workers, and :func:`ranks_needed` adds the servers), ``mesh`` (dp × pp × tp; all
tp ranks and pp stages of one dp replica read the same shard: world / (tp · pp) shards).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from disttrain.comm.transport import check_workload
from disttrain.parallel import presets
from disttrain.parallel.presets import Preset
from disttrain.train.config import ParallelOptions, TrainConfig
from disttrain.train.strategies.base import (
    Batch,
    BuildContext,
    LossFn,
    OptimizerFactory,
    Strategy,
    optimizer_class,
    optimizer_factory,
)
from disttrain.train.strategies.compose import compose
from disttrain.train.strategies.data_parallel import build_single
from disttrain.train.strategies.mesh import check_mesh, mesh_settings, mesh_workload
from disttrain.train.strategies.parameter_server import (
    build_parameter_server_strategy,
    losable_ranks,
    num_servers,
)
from disttrain.train.strategies.pipeline import DEFAULT_MICROBATCHES

Builder = Callable[[BuildContext], Strategy]
Check = Callable[[TrainConfig, int, int], None]  # (config, world_size, dp_size)

OPTION_FLAGS = {  # ParallelOptions field → its `disttrain run` flag
    "bucket_cap_mb": "--bucket-cap-mb", "find_unused_parameters": "--find-unused-parameters",
    "broadcast_buffers": "broadcast_buffers", "compression": "--compression",
    "algorithm": "--algorithm", "schedule": "--schedule", "microbatches": "--microbatches",
    "partition": "--partition", "pp_size": "--pp", "virtual_stages": "--virtual-stages",
    "servers": "--servers",
    "tp_size": "--tp", "dp_size": "--dp", "sequence_parallel": "--sequence-parallel",
    "zero": "--zero", "cp_size": "--cp", "cp_variant": "--cp-variant", "ep_size": "--ep",
    "dp_shard": "--dp-shard", "dp_replicate": "--dp-replicate", "meta_init": "--meta-init",
    "staleness": "--staleness", "staleness_lr": "--staleness-lr", "straggler": "--straggler",
    "straggler_every": "--straggler RANK:FACTOR:EVERY",
}
TORCH_DP = presets.DATA_PARALLEL
LAYOUTS = ("data", "pipeline", "model", "ps", "mesh")


@dataclass(frozen=True)
class StrategySpec:
    """A registry entry: how to build the strategy, what it accepts, how it shards data."""

    build: Builder
    description: str
    options: frozenset[str] = frozenset()  # ParallelOptions fields this strategy uses
    layout: str = "data"
    max_world_size: int | None = None
    needs_comm: bool = True
    check: Check | None = None  # further checks before any rank starts
    loss_scaling: bool = True  # --precision fp16 (the loop's scaler reaches its updates)
    # the ranks whose death a run outlives (config, world size → ranks); None: no rank's
    losable: Callable[[TrainConfig, int], frozenset[int]] | None = None
    # what its communication mostly is, "collectives" or "p2p" (or a function of config and
    # world size giving one); None: learned from use (the first isend/irecv says "p2p")
    workload: str | Callable[[TrainConfig, int], str | None] | None = None
    # a baseline's (disttrain/baselines/): whose implementation it is ("torch", "deepspeed")
    # and which of disttrain's presets it implements, for the benchmark's comparisons
    family: str | None = None
    baseline_of: tuple[str, ...] = ()
    unavailable: Callable[[], str | None] | None = None  # why it cannot run here, or None

    def __post_init__(self) -> None:
        if isinstance(self.workload, str):
            check_workload(self.workload)

    def make(self, ctx: BuildContext) -> Strategy:
        """Build the strategy on ``ctx``'s communicator, telling it the strategy's workload
        first, which schedules the process's Gloo I/O threads for it (idle under
        collectives: comm/transports/gloo_threads.py). The one place a strategy's
        communicator learns what it will carry."""
        workload = self.workload
        if callable(workload) and ctx.comm is not None:
            workload = workload(ctx.config, ctx.comm.world_size)
        if isinstance(workload, str) and ctx.comm is not None:
            ctx.comm.expect_workload(workload)
        return self.build(ctx)

    def losable_ranks(self, config: TrainConfig, world_size: int) -> frozenset[int]:
        """Ranks that may die without failing the run (a launcher must not stop the job for
        them): ps-async's and ps-ssp's workers."""
        return frozenset() if self.losable is None else self.losable(config, world_size)

    def data_parallel_size(self, world_size: int, config: TrainConfig | None = None) -> int:
        """How many ranks read different shards of each global batch."""
        if self.layout == "model":
            return 1
        if self.layout == "ps":
            servers = num_servers(config) if config is not None else 1
            return world_size - servers
        if self.layout == "pipeline":
            pp = config.parallel.pp_size if config is not None else None
            return world_size // (pp or world_size)
        if self.layout == "mesh":
            # ep is carved out of data parallelism: its ranks read different samples too
            shape = mesh_settings(config, world_size).shape if config is not None else None
            return shape.size(("dp", "ep")) if shape is not None else 1
        return world_size

    def check_world(self, world_size: int, name: str) -> None:
        if self.max_world_size is not None and world_size > self.max_world_size:
            raise ValueError(f"strategy {name!r} runs on at most {self.max_world_size} "
                             f"process(es), not {world_size}; use -n {self.max_world_size} "
                             f"or a parallel strategy such as 'ddp'")

    def check_config(self, config: TrainConfig, world_size: int) -> int:
        """Validate ``config`` for ``world_size`` ranks; returns the data-parallel size."""
        name = config.strategy
        self.check_world(world_size, name)
        _check_options(config.parallel, self.options, name)
        pp = config.parallel.pp_size
        if self.layout == "pipeline" and pp is not None and world_size % pp:
            raise ValueError(f"--pp {pp} does not divide the world size {world_size}: the ranks "
                             f"form world_size/pp pipelines of pp stages")
        if self.layout == "ps" and world_size <= num_servers(config):
            raise ValueError(f"strategy {name!r} with {num_servers(config)} server(s) needs "
                             f"at least one worker, but the job has {world_size} rank(s); "
                             f"start more ranks (-n counts workers in 'disttrain run') or "
                             f"use fewer --servers")
        if self.layout in ("pipeline", "model") and config.accumulate != 1:
            raise ValueError(f"strategy {name!r} runs each step as one batch through its "
                             f"stages; --accumulate must be 1 (pipelines split batches with "
                             f"--microbatches)")
        if config.precision == "fp16" and not self.loss_scaling:
            raise ValueError(f"--precision fp16 needs dynamic loss scaling, which strategy "
                             f"{name!r} does not take (its updates do not go through the "
                             f"loop's optimizer step); use --precision bf16 (no scaling "
                             f"needed) or fp32")
        if config.clip_grad_norm is not None:
            _check_clipping(config, self)
        _check_blocks(config, self)
        dp = self.data_parallel_size(world_size, config)
        config.micro_batch(dp)  # raises with the fix when the global batch does not split
        if self.check is not None:
            self.check(config, world_size, dp)
        if self.layout in ("pipeline", "model"):
            _check_layers(config, world_size // dp)
        return dp


def _check_blocks(config: TrainConfig, spec: StrategySpec) -> None:
    """--activation-checkpointing and --compile where they can act (train/blocks.py)."""
    wrapped = config.activation_checkpointing != "none" or config.compile
    if wrapped and spec.family is not None:
        raise ValueError(f"--activation-checkpointing and --compile apply to disttrain's "
                         f"strategies; {config.strategy!r} is {spec.family}'s own")
    if config.compile and (presets.PRESETS.get(config.strategy, presets.PRESETS["single"])
                           .zero == 3 or config.parallel.zero == 3):
        raise ValueError("--compile cannot run under ZeRO-3, which swaps each unit's "
                         "parameters in and out around its forward; use zero2 or drop "
                         "--compile")


def _check_clipping(config: TrainConfig, spec: StrategySpec) -> None:
    """--clip-grad-norm where the global norm can be taken (train/clipping.py)."""
    name = config.strategy
    if spec.family is not None:
        raise ValueError(f"--clip-grad-norm applies to disttrain's strategies; {name!r} is "
                         f"{spec.family}'s own implementation, which clips its own way")
    if spec.layout == "ps":
        raise ValueError(f"--clip-grad-norm: strategy {name!r} applies each worker's gradient "
                         f"on the servers, where no whole-model norm exists; drop the flag")


def _check_options(opts: ParallelOptions, accepted: frozenset[str], name: str) -> None:
    defaults = ParallelOptions()
    for field in dataclasses.fields(opts):
        if field.name in accepted or getattr(opts, field.name) == getattr(defaults, field.name):
            continue
        users = [n for n, spec in STRATEGIES.items() if field.name in spec.options]
        hint = " (for gradient accumulation use --accumulate)" if (
            field.name == "microbatches") else ""
        raise ValueError(f"{OPTION_FLAGS[field.name]} does not apply to strategy {name!r}; "
                         f"it applies to: {', '.join(users)}{hint}")


def check_pipeline(config: TrainConfig, world_size: int, dp: int) -> None:
    name, opts = config.strategy, config.parallel
    schedule = "gpipe" if name == "torch-gpipe" else name
    if opts.schedule is not None and opts.schedule != schedule:
        raise ValueError(f"--schedule {opts.schedule} contradicts strategy {name!r}, whose "
                         f"schedule is {schedule}; use --strategy {opts.schedule} (or "
                         f"--strategy pipeline --schedule {opts.schedule})")
    m = opts.microbatches or DEFAULT_MICROBATCHES
    local = config.global_batch // dp
    if local < m:
        raise ValueError(f"global batch {config.global_batch} gives each of the {dp} pipeline "
                         f"replica(s) {local} samples per step, fewer than {m} micro-batches; "
                         f"use --microbatches {local} or less, or a larger --global-batch")
    _check_interleaving(config, world_size // dp, m)
    if name == "torch-gpipe":
        if local % m:
            raise ValueError(f"torch-gpipe needs equal micro-batches: {local} samples per "
                             f"step do not split into {m}; use a --global-batch that is a "
                             f"multiple of {m}")
        if config.checkpoint_dir is not None:
            raise ValueError("torch-gpipe is a benchmark baseline and writes no checkpoints; "
                             "use --strategy gpipe for checkpointed pipeline training")


def _check_interleaving(config: TrainConfig, pp: int, m: int) -> None:
    """--virtual-stages V (interleaved 1F1B) needs stages to interleave and, as in
    Megatron-LM, micro-batches in groups of pp."""
    v = config.parallel.virtual_stages or 1
    if v > 1 and pp < 2:
        raise ValueError(f"--virtual-stages {v} interleaves the chunks of several pipeline "
                         f"stages; this run has one: use --pp ≥ 2 (and -n ≥ 2)")
    if v > 1 and m % pp:
        raise ValueError(f"--virtual-stages {v} (interleaved 1F1B) sends micro-batches round "
                         f"the {pp} stages in groups of {pp}, as Megatron-LM does: use a "
                         f"--microbatches that is a multiple of {pp}, not {m}")


def _check_layers(config: TrainConfig, stages: int) -> None:
    """Refuse more stages (or, with --virtual-stages V, pieces: stages × V) than the model
    has layers, or a --partition that does not fit it, before any rank starts: the model is
    built here once, on the CPU, to count them."""
    from disttrain.parallel.pipeline import partition as part
    from disttrain.train.data import build_dataset
    from disttrain.train.models import build_model
    from disttrain.train.strategies.hf import pipeline_view

    info = build_dataset(config.dataset, config.data).info
    model = build_model(config.model, info, config.model_config)
    if get_strategy(config.strategy).family is None:  # the baselines cut the model as it is
        model = pipeline_view(model)
    layers = part.layers_of(model)
    v = config.parallel.virtual_stages or 1
    if v > 1 and len(layers) < stages * v:
        raise ValueError(f"--virtual-stages {v} cuts model {config.model!r} into {stages} "
                         f"stages × {v} = {stages * v} pieces of at least one layer, but it "
                         f"has {len(layers)} layers: use --virtual-stages "
                         f"{max(1, len(layers) // stages)} or less")
    stages *= v
    partition = config.parallel.partition
    if isinstance(partition, tuple) and all(isinstance(p, str) for p in partition):
        part.balance_at(part.layer_names(model, layers), [str(p) for p in partition], stages)
    elif isinstance(partition, tuple):
        part.check_balance([int(p) for p in partition], len(layers), stages)
    else:
        part.check_stages(len(layers), stages)


def _check_ps(config: TrainConfig, world_size: int, dp: int) -> None:
    late = sorted(r for r, _ in config.parallel.straggler if r >= dp)
    if late:
        raise ValueError(f"--straggler ranks {late} are not workers: with {dp} worker(s) the "
                         f"workers are ranks 0..{dp - 1} (the servers come after them)")
    if config.checkpoint_dir is not None and config.checkpoint_every:
        raise ValueError(f"strategy {config.strategy!r} checkpoints at the end of a run only: "
                         f"its servers serve the whole run, so the ranks cannot meet mid-run; "
                         f"drop --checkpoint-every (split training into runs of --steps N and "
                         f"continue each with --resume)")


def ranks_needed(config: TrainConfig, workers: int) -> int:
    """Processes a run with ``workers`` data-parallel workers starts (PS: + the servers)."""
    spec = STRATEGIES.get(config.strategy)
    return workers + num_servers(config) if spec is not None and spec.layout == "ps" else (
        workers)


def _check_data_mesh(config: TrainConfig, world_size: int, dp: int) -> None:
    mesh_settings(config, world_size)  # --dp-shard × --dp-replicate must equal dp


def spec_for(preset: Preset) -> StrategySpec:
    """How the loop builds and checks a preset: the composer for every composition, the
    servers' builder for the parameter servers; its layout, checks and workload follow
    from its dimensions and options."""
    kind, options = preset.kind, preset.options
    if preset.reference:
        return StrategySpec(build_single, preset.description, max_world_size=1,
                            needs_comm=False)
    if kind == "ps":
        return StrategySpec(build_parameter_server_strategy, preset.description, options, "ps",
                            check=_check_ps, loss_scaling=False,
                            losable=losable_ranks if preset.parameter_server != "sync" else None)
    if kind == "mesh":
        return StrategySpec(compose, preset.description, options, "mesh", check=check_mesh,
                            workload=mesh_workload)
    if kind == "data":  # the mesh's sizes (hybrid sharding's) checked before ranks start
        return StrategySpec(compose, preset.description, options, workload="collectives",
                            check=_check_data_mesh)
    return StrategySpec(compose, preset.description, options, kind,
                        check=check_pipeline if preset.microbatches is None else None)


PRESETS: dict[str, StrategySpec] = {name: spec_for(preset)
                                    for name, preset in presets.PRESETS.items()}
"""disttrain's own strategies: every preset of :mod:`disttrain.parallel.presets`."""

PLUGINS = ("disttrain.baselines",)  # packages with a registry of their own, loaded when asked


class Registry(Mapping[str, StrategySpec]):
    """disttrain's strategies, then the baselines' (PyTorch's and DeepSpeed's own
    implementations, in disttrain/baselines/), found by name: the baselines' package is
    imported the first time a name is not disttrain's or the whole registry is listed, so
    that disttrain's own modules never import it."""

    def __init__(self, own: dict[str, StrategySpec], plugins: tuple[str, ...]) -> None:
        self._own, self._plugins = own, plugins
        self._loaded: dict[str, StrategySpec] | None = None

    def _all(self) -> dict[str, StrategySpec]:
        if self._loaded is None:
            merged = dict(self._own)
            for module in self._plugins:
                merged.update(importlib.import_module(module).BASELINES)
            self._loaded = merged
        return self._loaded

    def __getitem__(self, name: str) -> StrategySpec:
        if name in self._own:
            return self._own[name]
        return self._all()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._own or name in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


STRATEGIES: Mapping[str, StrategySpec] = Registry(PRESETS, PLUGINS)
"""Every strategy by name: disttrain's (:data:`PRESETS`), then the baselines'."""

PLANNED: dict[str, str] = {}
"""Names the benchmark issue reserves whose implementation is not in the registry yet."""


def get_strategy(name: str) -> StrategySpec:
    try:
        return STRATEGIES[name]
    except KeyError:
        pass
    if name in PLANNED:
        raise ValueError(f"strategy {name!r} ({PLANNED[name]}) is not available yet; choose "
                         f"one of: {', '.join(STRATEGIES)}")
    raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")


__all__ = [
    "LAYOUTS",
    "OPTION_FLAGS",
    "PLANNED",
    "PRESETS",
    "STRATEGIES",
    "Batch",
    "BuildContext",
    "LossFn",
    "OptimizerFactory",
    "Strategy",
    "StrategySpec",
    "get_strategy",
    "optimizer_class",
    "optimizer_factory",
    "ranks_needed",
]
