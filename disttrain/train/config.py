"""TrainConfig: everything one training run needs, validated on creation.

The CLI maps its flags onto these fields; the benchmark builds them directly. Checks that
need the world size (the global batch must split evenly over the data-parallel ranks) run
in :func:`check_world` once the communicator is known.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from disttrain.train.data import DataOptions
from disttrain.train.device import check_device
from disttrain.train.schedule import SCHEDULES

OPTIMIZERS = ("sgd", "adam", "adamw")
PRECISIONS = ("fp32", "bf16", "fp16")  # fp16: with dynamic loss scaling (the loop's)
DTYPES = ("float32", "float64")  # the parameters' (and float inputs') dtype


PIPELINE_SCHEDULES = ("gpipe", "1f1b")
STALENESS_LR = ("inverse", "none")  # as disttrain.parallel.parameter_server.STALENESS_LR
PARTITIONS = ("params", "time")


@dataclass(frozen=True)
class ParallelOptions:
    """Options of the parallel strategies. Each applies to some strategies only (the
    registry in :mod:`disttrain.train.strategies` says which; a setting given to a strategy
    it does not apply to is an error, not silently ignored)."""

    # data parallel ("ddp", "torch-ddp", "torch-zero1")
    bucket_cap_mb: float = 25.0  # gradient bucket size
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    compression: str | None = None  # "ddp" only: a name disttrain.parallel understands
    algorithm: str | None = None  # "ddp", "zero1-3": collective algorithm (None: auto)
    # pipeline ("gpipe", "1f1b", "torch-gpipe") and model parallel ("model-parallel")
    schedule: str | None = None  # "gpipe" or "1f1b": must agree with the strategy's name
    microbatches: int | None = None  # micro-batches per step (None: 8)
    # "params", "time", layers per stage (3, 2, 2) or the layer names where stages 1, 2, …
    # start ("blocks.2", "head")
    partition: str | tuple[int, ...] | tuple[str, ...] | None = None
    pp_size: int | None = None  # stages per pipeline (None: every rank is a stage; "3d": 1)
    virtual_stages: int | None = None  # "1f1b": model chunks per stage, interleaved (None: 1)
    # tensor parallel and the dp × pp × tp mesh ("tp", "tp-sp", "3d", "torch-tp")
    tp_size: int | None = None  # "3d": ranks per tensor-parallel group (None: 1)
    dp_size: int | None = None  # "3d": data-parallel replicas (None: world / (tp · pp))
    sequence_parallel: bool = False  # shard LayerNorm regions along the sequence (tp-sp)
    cp_size: int | None = None  # "cp", "3d": ranks a sequence is split over (context parallel)
    cp_variant: str = "ring"  # "ring" (key/value blocks around a ring) or "ulysses" (heads)
    ep_size: int | None = None  # "ep": ranks the experts are spread over (expert parallel)
    # "zero1-3": hybrid sharding, shard inside groups of dp_shard ranks and replicate across
    # dp_replicate groups (None: plain ZeRO over every data-parallel rank)
    dp_shard: int | None = None
    dp_replicate: int | None = None
    # "zero1-3": build the model on the meta device; the wrapper materialises each rank's
    # shards one unit at a time (equal to eager initialisation; docs/zero.md)
    meta_init: bool = False
    zero: int | None = None  # "3d": ZeRO stage 1, 2 or 3 over the dp groups (None: plain DP)
    # parameter server ("ps-sync", "ps-async", "ps-ssp")
    servers: int | None = None  # server processes beside the workers (None: 1)
    staleness: int | None = None  # "ps-ssp": clocks a worker may run ahead (None: 2)
    staleness_lr: str | None = None  # "ps-async", "ps-ssp": lr ÷ staleness or not (None: inverse)
    straggler: tuple[tuple[int, float], ...] = ()  # (worker rank, factor ≥ 1): slowed workers
    straggler_every: int | None = None  # rotate each slow-down to the next worker every N steps

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.schedule is not None and self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got "
                             f"{self.schedule!r}")
        for name in ("microbatches", "pp_size", "servers", "tp_size", "dp_size", "cp_size",
                     "ep_size", "dp_shard", "dp_replicate"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.virtual_stages is not None:
            _positive("virtual_stages", self.virtual_stages)
        if self.cp_variant not in ("ring", "ulysses"):
            raise ValueError(f"cp_variant must be ring or ulysses, got {self.cp_variant!r}")
        if self.staleness is not None:
            _positive("staleness", self.staleness, allow_zero=True)
        if self.zero is not None and (isinstance(self.zero, bool) or self.zero not in (1, 2, 3)):
            raise ValueError(f"zero must be 1, 2 or 3 (the ZeRO stage over the dp groups of "
                             f"the mesh), got {self.zero!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be True or False, got "
                             f"{self.sequence_parallel!r}")
        if self.staleness_lr not in (None, *STALENESS_LR):
            raise ValueError(f"staleness_lr must be one of {', '.join(STALENESS_LR)}, got "
                             f"{self.staleness_lr!r}")
        object.__setattr__(self, "straggler", _stragglers(self.straggler))
        if self.straggler_every is not None:
            _positive("straggler_every (steps before a slow-down moves on)", self.straggler_every)
            if not self.straggler:
                raise ValueError("straggler_every needs a straggler: the rank and factor the "
                                 "rotating slow-down starts with (--straggler RANK:FACTOR:EVERY)")
        partition = self.partition
        if isinstance(partition, str):
            if partition not in PARTITIONS:
                raise ValueError(f"partition must be 'params', 'time' or layer counts per "
                                 f"stage like (3, 2, 2), got {partition!r}")
        elif partition is not None:
            balance = tuple(partition)
            if not balance:
                raise ValueError("partition needs one layer count per stage, got ()")
            if all(isinstance(entry, str) for entry in balance):  # split points, by name
                object.__setattr__(self, "partition", balance)
                return
            for count in balance:
                _positive("each entry of partition (layers per stage)", count)
            object.__setattr__(self, "partition", balance)


def _stragglers(value: object) -> tuple[tuple[int, float], ...]:
    """``{rank: factor}`` or ``((rank, factor), ...)`` → sorted pairs, validated."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (tuple, list)) and all(
            isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise ValueError(f"straggler must be {{rank: factor}} or ((rank, factor), ...), "
                         f"got {value!r}")
    checked: dict[int, float] = {}
    for rank, factor in pairs:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 or rank in checked:
            raise ValueError(f"straggler ranks must be distinct ints ≥ 0, got {value!r}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                1.0 <= factor < math.inf):
            raise ValueError(f"straggler factor for rank {rank} must be a finite number ≥ 1 "
                             f"(2 = twice as slow), got {factor!r}")
        checked[rank] = float(factor)
    return tuple(sorted(checked.items()))


def _positive(name: str, value: object, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int ≥ {low}, got {value!r}")


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Give ``epochs`` or ``steps`` (neither: one epoch).

    ``dataclasses.replace`` works as usual; to switch from epochs to steps, set the other to
    None (``replace(config, epochs=None, steps=100)``).
    """

    model: str = "lenet"  # registry name, "hf:gpt2", "hf:llama" or "package.module:factory"
    model_config: str | None = None  # hf: models: their transformers config, a JSON file
    dataset: str = "digits"  # registry name or "package.module:factory"
    strategy: str = "single"  # a STRATEGIES name; "pipeline" means parallel.schedule (1f1b)
    data: DataOptions = field(default_factory=DataOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    epochs: int | None = None
    steps: int | None = None  # optimizer steps in total (overrides epochs)
    global_batch: int = 32  # samples per optimizer step over all data-parallel ranks
    accumulate: int = 1  # micro-batches per step on each rank (gradient accumulation)
    optimizer: str = "sgd"
    lr: float = 0.05
    lr_schedule: str = "constant"  # "constant", "linear", "cosine" (disttrain.train.schedule)
    warmup_steps: int = 0  # learning-rate warmup: steps rising linearly towards lr
    min_lr: float = 0.0  # the rate "linear" and "cosine" end the run at
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0
    # no weight decay on biases and norm weights (parameters of < 2 dimensions), the rest at
    # weight_decay: two parameter groups under every strategy (strategies/base.py)
    no_decay_norms_biases: bool = False
    seed: int = 0  # model init (same on every rank) and data order
    precision: str = "fp32"
    clip_grad_norm: float | None = None  # clip the whole model's gradient to this norm
    activation_checkpointing: str = "none"  # "full", "selective" (train/blocks.py)
    compile: bool = False  # torch.compile each block
    compile_backend: str = "inductor"  # "aot_eager" needs no C++ compiler
    dtype: str = "float32"  # parameters and float inputs; float64 for numerical checks
    device: str = "auto"  # "auto", "cpu", "cuda" (this rank's GPU) or "cuda:N" (train/device.py)
    eval_every: int | None = None  # None: after each epoch; 0: only at the end; N: every N steps
    log_every: int = 10  # steps between metrics lines (0: none)
    untimed_steps: int = 1  # first steps left out of samples/s (their activations measured)
    peak_tflops: float | None = None  # one device's peak, for model FLOPs utilization
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps between checkpoints (0: only at the end)
    resume: bool = False  # continue from the newest checkpoint in checkpoint_dir
    tensorboard_dir: str | None = None  # written by rank 0 when tensorboard is installed
    progress: bool | None = None  # progress bar on rank 0 (None: when stderr is a terminal)

    def __post_init__(self) -> None:
        if self.strategy == "pipeline":  # the spelling: --strategy pipeline --schedule X
            object.__setattr__(self, "strategy", self.parallel.schedule or "1f1b")
        if self.epochs is not None and self.steps is not None:
            raise ValueError("give epochs or steps, not both")
        if self.model_config is not None and not self.model.startswith("hf:"):
            raise ValueError(f"model_config (--model-config) is the config of a Hugging Face "
                             f"model (--model hf:gpt2 or hf:llama); model {self.model!r} "
                             f"takes none")
        if self.epochs is not None:
            _positive("epochs", self.epochs)
        if self.steps is not None:
            _positive("steps", self.steps)
        _positive("global_batch", self.global_batch)
        _positive("accumulate", self.accumulate)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, "
                             f"got {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")
        if self.activation_checkpointing not in ("none", "full", "selective"):
            raise ValueError(f"activation_checkpointing must be none, full or selective, got "
                             f"{self.activation_checkpointing!r}")
        if not isinstance(self.compile, bool) or not self.compile_backend:
            raise ValueError(f"compile must be True or False and compile_backend a torch."
                             f"compile backend, got {self.compile!r}, {self.compile_backend!r}")
        norm = self.clip_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                                 or not 0 < norm < float("inf")):
            raise ValueError(f"clip_grad_norm must be a positive number (the largest global "
                             f"gradient norm), got {self.clip_grad_norm!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_device(self.device)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not isinstance(self.no_decay_norms_biases, bool):
            raise ValueError(f"no_decay_norms_biases must be True or False, got "
                             f"{self.no_decay_norms_biases!r}")
        if not 0 <= self.momentum < 1 or self.weight_decay < 0:
            raise ValueError(f"momentum must be in [0, 1) and weight_decay ≥ 0, got "
                             f"{self.momentum}, {self.weight_decay}")
        if self.eval_every is not None:
            _positive("eval_every", self.eval_every, allow_zero=True)
        for name in ("log_every", "warmup_steps", "untimed_steps", "checkpoint_every"):
            _positive(name, getattr(self, name), allow_zero=True)
        self._check_schedule()
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume=True needs checkpoint_dir (where to find the checkpoint)")

    def _check_schedule(self) -> None:
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(SCHEDULES)}, got "
                             f"{self.lr_schedule!r}")
        if isinstance(self.min_lr, bool) or not isinstance(self.min_lr, (int, float)) or not (
                0 <= self.min_lr <= self.lr):
            raise ValueError(f"min_lr must be a number between 0 and lr ({self.lr:g}), got "
                             f"{self.min_lr!r}")
        peak = self.peak_tflops
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float))
                                 or not 0 < peak < math.inf):
            raise ValueError(f"peak_tflops must be a positive number (one device's peak "
                             f"TFLOP/s), got {peak!r}")

    def micro_batch(self, dp_size: int) -> int:
        """Samples per forward pass on one data-parallel rank."""
        per_step = dp_size * self.accumulate
        if self.global_batch % per_step:
            raise ValueError(
                f"global batch {self.global_batch} does not split evenly over {dp_size} "
                f"data-parallel rank(s) × {self.accumulate} micro-batch(es); use a multiple "
                f"of {per_step}, e.g. {max(1, round(self.global_batch / per_step)) * per_step}")
        return self.global_batch // per_step
