"""The named experiments of ``disttrain bench``: one per registered training strategy.

An experiment is a strategy of :data:`disttrain.train.STRATEGIES` plus how the benchmark runs
it: which transport (the baselines, PyTorch's and DeepSpeed's, always run on ``torch``: they
call torch.distributed themselves), which collective algorithm (by default ``auto``: the
``shm`` algorithm on the shared-memory transport, whose bytes are counted), and which
PyTorch and DeepSpeed implementations of the same idea it is compared with: each baseline
says which presets it implements (``baseline_of`` in disttrain/baselines/), e.g. ``zero3``
against ``torch-fsdp`` and ``deepspeed-zero3``.

The list is read from the strategy registry at run time, so a strategy registered there is a
row here with nothing else to do. A row whose optional dependency is missing (DeepSpeed) is
skipped with a note, not failed.

Parameter-server rows (``ps-sync``, ``ps-async``, ``ps-ssp``): ``-n W`` means W workers, and
each run starts ``servers`` more ranks; ``straggler`` and ``staleness`` apply to them only.

Tensor-parallel rows (``tp``, ``tp-sp``, ``3d``, ``torch-tp``, ``torch-tp-sp``) split a
transformer: they are planned by default only with ``--model transformer``; asked for by
name with another model, each is a row refused with the reason. ``3d`` runs on a mesh of
``tp_size`` × ``pp_size`` (dp takes the rest of the ranks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from disttrain.bench.presets import DEFAULT_PRESET, get_preset
from disttrain.parallel.presets import zero_presets
from disttrain.train.config import OPTIMIZERS
from disttrain.train.data import DataOptions
from disttrain.train.device import check_device
from disttrain.train.models import MOE_MODELS, TRANSFORMER_MODELS, is_hf_model
from disttrain.train.strategies import STRATEGIES

REFERENCE = "single"
# the fastest disttrain has on one machine: shared memory and its own algorithm, whose bytes
# comm.stats counts (docs/shm_transport.md); --transport torch --algorithm ring measures the
# classic ring over Gloo instead
DEFAULT_TRANSPORT = "auto"
DEFAULT_ALGORITHM = "auto"
DEFAULT_WORLD_SIZES = (2,)
_DEFAULTS = get_preset(DEFAULT_PRESET)
DEFAULT_EPOCHS = _DEFAULTS.epochs or 1


@dataclass(frozen=True)
class Experiment:
    """One row kind of the table: a strategy and how the benchmark runs it."""

    name: str
    description: str
    is_baseline: bool  # PyTorch's or DeepSpeed's implementation (on the torch transport)
    compare_to: str | None  # the torch baseline of the same idea, when there is one
    takes_algorithm: bool  # the strategy accepts ParallelOptions.algorithm
    max_world_size: int | None
    parameter_server: bool = False  # -n counts workers; the servers are extra ranks
    takes_staleness: bool = False
    needs_transformer: bool = False  # splits a TransformerLM (the mesh strategies)
    needs_experts: bool = False  # spreads mixture-of-experts layers (ep)
    compare_to_deepspeed: str | None = None  # DeepSpeed's row of the same idea
    unavailable: str | None = None  # why it cannot run here (a missing optional package)


def counterparts(family: str) -> dict[str, str]:
    """disttrain's preset → the baseline of ``family`` ("torch", "deepspeed") that
    implements the same idea, as the baselines' registry says (``baseline_of``)."""
    return {preset: name for name, spec in STRATEGIES.items() if spec.family == family
            for preset in spec.baseline_of}


def experiments() -> dict[str, Experiment]:
    """Every registered strategy as an experiment: the reference first, then torch's
    baselines, then disttrain's strategies (so a row's comparisons are known when it ends)."""
    torch_rows, deepspeed_rows = counterparts("torch"), counterparts("deepspeed")
    found = {}
    for name, spec in STRATEGIES.items():
        found[name] = Experiment(
            name=name, description=spec.description,
            is_baseline=spec.family is not None, compare_to=torch_rows.get(name),
            takes_algorithm="algorithm" in spec.options, max_world_size=spec.max_world_size,
            parameter_server=spec.layout == "ps", takes_staleness="staleness" in spec.options,
            needs_transformer=spec.layout == "mesh" and "ep_size" not in spec.options,
            needs_experts="ep_size" in spec.options,
            compare_to_deepspeed=deepspeed_rows.get(name),
            unavailable=spec.unavailable() if spec.unavailable is not None else None)
    order = sorted(found, key=lambda n: (n != REFERENCE, not found[n].is_baseline))
    return {name: found[name] for name in order}


@dataclass(frozen=True)
class BenchConfig:
    """What ``disttrain bench`` runs. ``strategies`` None means every registered one; the
    single-process reference always runs (once, on one process) since every row is compared
    with it."""

    strategies: tuple[str, ...] | None = None
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    preset: str = DEFAULT_PRESET  # recorded; BenchConfig.from_preset fills the fields below
    model: str = _DEFAULTS.model
    model_config: str | None = None  # hf:gpt2, hf:llama: the transformers config (JSON file)
    dataset: str = _DEFAULTS.dataset
    data: DataOptions = _DEFAULTS.data
    optimizer: str = _DEFAULTS.optimizer
    lr: float = _DEFAULTS.lr
    momentum: float = _DEFAULTS.momentum  # sgd only
    epochs: int | None = None  # neither epochs nor steps: DEFAULT_EPOCHS
    steps: int | None = None
    global_batch: int = _DEFAULTS.global_batch
    repeat: int = 1
    transport: str = DEFAULT_TRANSPORT  # disttrain rows only; baselines always use torch
    algorithm: str = DEFAULT_ALGORITHM  # for strategies that take one ('auto' allowed)
    reference_threads: int | None = None  # the single process's (None: see .threads_of)
    timeout_s: float = 60.0  # any collective; a rank silent for 4× this is stopped
    untimed_steps: int = 2  # left out of samples/s (and the steps whose activations count)
    peak_tflops: float | None = None  # one device's peak: the MFU column (None: no column)
    eval_every: int = _DEFAULTS.eval_every  # steps between evaluations (accuracy curves)
    seed: int = 0
    servers: int = 1  # parameter-server rows: server ranks beside the -n workers
    staleness: int | None = None  # ps-ssp rows (None: the strategy's default, 2)
    staleness_lr: str | None = None  # ps-async/ps-ssp learning-rate rule (None: default)
    straggler: tuple[tuple[int, float], ...] = ()  # parameter-server rows: slowed workers
    straggler_every: int | None = None  # ... each slow-down moving to the next worker every N
    bind_cores: bool = False  # pin each rank to a core of its own (when ranks ≤ cores)
    tp_size: int = 2  # "3d" rows: ranks per tensor-parallel group
    pp_size: int = 1  # "3d" rows: pipeline stages (dp = world / (tp · pp))
    dp_shard: int | None = None  # ZeRO rows: hybrid sharding in groups of this many ranks
    meta_init: bool = False  # ZeRO rows: each also run built on the meta device
    activation_checkpointing: str = "none"  # not none: every row also run with it (+ac)
    compile: bool = False  # every row also run with its blocks compiled (+compile)
    compile_backend: str = "inductor"
    device: str = "auto"  # where every rank trains (disttrain.train.device)
    backend: str = "auto"  # torch.distributed backend of the ranks (auto: by the device)
    extra: dict[str, str] = field(default_factory=dict)  # recorded in the environment

    def __post_init__(self) -> None:
        if self.epochs is not None and self.steps is not None:
            raise ValueError("give --epochs or --steps, not both")
        for name in ("repeat", "global_batch", "epochs", "steps"):
            value = getattr(self, name)
            if value is None and name in ("epochs", "steps"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer ≥ 1, "
                                 f"got {value!r}")
        if not self.world_sizes or any(n < 1 for n in self.world_sizes):
            raise ValueError(f"-n needs world sizes ≥ 1, got {self.world_sizes}")
        if isinstance(self.servers, bool) or not isinstance(self.servers, int) or (
                self.servers < 1):
            raise ValueError(f"--servers must be an integer ≥ 1, got {self.servers!r}")
        if self.staleness is not None and (isinstance(self.staleness, bool) or not isinstance(
                self.staleness, int) or self.staleness < 0):
            raise ValueError(f"--staleness must be an integer ≥ 0, got {self.staleness!r}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be ≥ 0 (0: only at the end), got "
                             f"{self.eval_every}")
        for name in ("tp_size", "pp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name[:2]} must be an integer ≥ 1, got {value!r}")
        check_device(self.device)
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"--backend must be auto, gloo or nccl, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"--comm-timeout must be > 0 seconds, got {self.timeout_s}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got "
                             f"{self.optimizer!r}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.reference_threads is not None and (isinstance(self.reference_threads, bool)
                                                   or not isinstance(self.reference_threads,
                                                                     int)
                                                   or self.reference_threads < 1):
            raise ValueError(f"--reference-threads must be an integer ≥ 1, got "
                             f"{self.reference_threads!r}")
        known = experiments()
        for name in self.strategies or ():
            if name not in known:
                raise ValueError(f"unknown strategy {name!r}; registered: {', '.join(known)} "
                                 f"(see disttrain bench --list)")

    @classmethod
    def from_preset(cls, name: str = DEFAULT_PRESET, **overrides: Any) -> BenchConfig:
        """The preset's workload with ``overrides`` (None values are left to the preset):
        ``BenchConfig.from_preset("lenet-digits", steps=20)``."""
        preset = get_preset(name)
        known = {f.name for f in fields(preset)} - {"description"}
        values = {f: getattr(preset, f) for f in known}
        given = {k: v for k, v in overrides.items() if v is not None}
        if "epochs" in given or "steps" in given:  # the given length replaces the preset's
            values["epochs"] = values["steps"] = None
        return cls(preset=name, **{**values, **given})

    def threads_of(self, run: Run) -> int:
        """Intra-op threads of each rank of ``run``: 1 for distributed rows; for the
        single-process reference ``reference_threads``, by default as many as the largest
        world size in the table, up to the cores this process may use, so that its
        speed-up compares processes on the same cores."""
        if run.experiment.name != REFERENCE:
            return 1
        if self.reference_threads is not None:
            return self.reference_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        return max(1, min(max(self.world_sizes), cores))

    @property
    def length(self) -> tuple[int | None, int | None]:
        """(epochs, steps) of every run: the steps if given, else the epochs (or default)."""
        if self.steps is not None:
            return None, self.steps
        return self.epochs or DEFAULT_EPOCHS, None

    def selected(self) -> list[Experiment]:
        """The experiments to run, in table order (the reference always first). By
        default every registered one, but the tensor-parallel ones only on a transformer and
        expert parallelism only on a model with experts
        (named explicitly, they run, or are refused with the reason); those that cannot run
        here are left out (:meth:`skipped` says why)."""
        known = experiments()
        wanted = set(self.strategies or self._default()) | {REFERENCE}
        return [e for name, e in known.items() if name in wanted and e.unavailable is None]

    def _default(self) -> list[str]:
        return [n for n, e in experiments().items()
                if (not e.needs_transformer or self.model in TRANSFORMER_MODELS
                    or is_hf_model(self.model))
                and (not e.needs_experts or self.model in MOE_MODELS)]

    def skipped(self) -> list[tuple[str, str]]:
        """(name, reason) of the wanted experiments that cannot run here."""
        known = experiments()
        wanted = set(self.strategies or self._default())
        return [(name, e.unavailable) for name, e in known.items()
                if name in wanted and e.unavailable is not None]


@dataclass(frozen=True)
class Run:
    """One cell of the plan: an experiment on a number of ranks."""

    experiment: Experiment
    world_size: int
    servers: int = 0  # parameter-server rows: server ranks started beside the workers
    variant: str = ""  # "", or a second row of the same strategy (VARIANTS)

    @property
    def name(self) -> str:
        """The row's name: the strategy's, ``+meta``, ``+ac`` or ``+compile`` for a variant."""
        return self.experiment.name + (f"+{self.variant}" if self.variant else "")

    @property
    def meta_init(self) -> bool:
        return self.variant == "meta"

    @property
    def label(self) -> str:
        extra = f"+{self.servers}" if self.servers else ""
        return f"{self.name} n={self.world_size}{extra}"

    @property
    def ranks(self) -> int:
        """Processes the run starts (the workers, plus a parameter server's servers)."""
        return self.world_size + self.servers


def plan(config: BenchConfig) -> list[Run]:
    """Every (experiment, world size) to run: the reference on one process, the others on
    each world size they accept (a strategy capped below a size is not planned there)."""
    runs = []
    for exp in config.selected():
        sizes = [1] if exp.name == REFERENCE else [
            n for n in config.world_sizes
            if exp.max_world_size is None or n <= exp.max_world_size]
        for n in sizes:
            runs.append(Run(exp, n, config.servers if exp.parameter_server else 0))
            runs += [Run(exp, n, variant=v) for v in variants(config, exp)]  # beside it
    return runs


VARIANTS = {"meta": "the model built on the meta device (--meta-init; ZeRO rows)",
            "ac": "activation checkpointing (--activation-checkpointing)",
            "compile": "the blocks compiled (--compile; not under ZeRO-3)"}


def variants(config: BenchConfig, exp: Experiment) -> list[str]:
    """The second rows ``exp`` gets beside its plain one: disttrain's own strategies only
    (the baselines and parameter servers train their own way)."""
    if exp.is_baseline or exp.parameter_server:
        return []
    out = ["meta"] if config.meta_init and exp.name in zero_presets() else []
    if config.activation_checkpointing != "none":
        out.append("ac")
    if config.compile and get_zero_stage(exp.name) != 3:
        out.append("compile")
    return out


def get_zero_stage(name: str) -> int:
    """The ZeRO stage a preset runs (0: none; a baseline or unknown name: 0)."""
    from disttrain.parallel.presets import PRESETS

    preset = PRESETS.get(name)
    return preset.zero if preset is not None else 0
