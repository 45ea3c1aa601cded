"""What a pipeline is asked to do (:class:`PipelineConfig`) and what its steps measured
(:class:`StepStats`, :class:`PipelineTotals`), plus the micro-batch split both depend on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from disttrain.parallel.pipeline import bundle
from disttrain.parallel.pipeline import partition as part
from disttrain.parallel.pipeline.schedules import SCHEDULES


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline settings; validated on creation. The CLI maps ``--schedule``,
    ``--microbatches``, ``--partition``, ``--pp`` and ``--virtual-stages`` onto these
    fields."""

    schedule: str = "1f1b"  # a key of SCHEDULES: "gpipe" or "1f1b"
    microbatches: int = 8  # m: each batch is cut into m micro-batches along dim 0
    partition: str | tuple[int, ...] = "params"  # "params", "time", or layers per piece
    pp_size: int | None = None  # stages per pipeline; None: every rank is a stage (dp = 1)
    virtual_stages: int = 1  # v: model chunks per stage (v > 1: interleaved 1F1B)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is unknown; choose one of: "
                             f"{', '.join(sorted(SCHEDULES))}")
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"microbatches must be an integer ≥ 1, got {m!r}")
        if isinstance(self.partition, str):
            if self.partition not in ("params", "time"):
                raise ValueError(f"partition={self.partition!r} is unknown; choose 'params', "
                                 f"'time' or a list of layer counts per stage")
        else:
            balance = tuple(self.partition)
            if not balance or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                  for b in balance):
                raise ValueError(f"partition {list(balance)} must list a layer count ≥ 1 "
                                 f"for each stage")
            object.__setattr__(self, "partition", balance)
        pp = self.pp_size
        if pp is not None and (isinstance(pp, bool) or not isinstance(pp, int) or pp < 1):
            raise ValueError(f"pp_size must be an integer ≥ 1 or None, got {pp!r}")
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"virtual_stages must be an integer ≥ 1, got {v!r}")
        if v > 1 and self.schedule != "1f1b":
            raise ValueError(f"virtual_stages={v} interleaves the 1f1b schedule; schedule "
                             f"{self.schedule!r} has no interleaved form: use schedule='1f1b' "
                             f"or virtual_stages=1")

    def check_stages(self, stages: int, layers: int) -> None:
        """What only the pipeline's size tells: interleaving needs ≥ 2 stages, micro-batches
        in groups of p (as Megatron-LM's schedule does) and a layer for each of p·v pieces."""
        v, m = self.virtual_stages, self.microbatches
        if v == 1:
            return
        if stages < 2:
            raise ValueError(f"virtual_stages={v} interleaves the chunks of several stages; "
                             f"this pipeline has {stages}: use pp_size ≥ 2 or virtual_stages=1")
        if m % stages:
            raise ValueError(f"interleaved 1F1B (virtual_stages={v}) sends micro-batches round "
                             f"the {stages} stages in groups of {stages}, as Megatron-LM does: "
                             f"use a multiple of {stages} micro-batches, not {m}")
        if layers < stages * v:
            raise part.PartitionError(
                f"cannot cut {layers} layers into {stages} stages × {v} virtual stages = "
                f"{stages * v} pieces: every piece needs a layer; use fewer virtual stages or "
                f"a model with more layers")


@dataclass(frozen=True)
class StepStats:
    """One training step on one rank."""

    wall_s: float  # the whole train_step on this rank
    busy_s: float  # forward + backward compute of this stage
    allreduce_s: float  # averaging gradients over the dp group
    peak_stashed: int  # most micro-batches held between forward and backward
    peak_activation_bytes: int  # the bytes autograd saved for them, at that peak
    wait_s: float = 0.0  # blocked waiting for the neighbours' messages (the bubble and latency)

    @property
    def idle_fraction(self) -> float:
        """Share of the step not spent computing: the bubble, plus communication."""
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class PipelineTotals:
    """Sums over steps, for an idle fraction measured over many steps (a single step's
    wall time depends on when this rank entered it; over consecutive steps it does not)."""

    steps: int = 0
    wall_s: float = 0.0
    busy_s: float = 0.0
    allreduce_s: float = 0.0
    peak_stashed: int = 0
    peak_activation_bytes: int = 0
    wait_s: float = 0.0

    def add(self, step: StepStats) -> None:
        self.steps += 1
        self.wall_s += step.wall_s
        self.busy_s += step.busy_s
        self.wait_s += step.wait_s
        self.allreduce_s += step.allreduce_s
        self.peak_stashed = max(self.peak_stashed, step.peak_stashed)
        self.peak_activation_bytes = max(self.peak_activation_bytes, step.peak_activation_bytes)

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


def split_batch(batch: Any, microbatches: int, what: str) -> list[Any]:
    """Cut ``batch`` (a tensor, or a tuple, list or dict of tensors of equal rows) into
    ``microbatches`` pieces along dim 0. Sizes differ by at most one row when the batch does
    not divide evenly (the loss weights each piece by its rows)."""
    if batch is None:
        raise ValueError(f"this stage needs the {what}, got None")
    if not isinstance(batch, torch.Tensor):
        bundle.leaves(batch, f"the {what}")  # tensors only: a one-line error otherwise
    rows = bundle.rows_of(batch)
    if rows < microbatches:
        raise ValueError(f"a batch of {rows} samples ({what}) cannot be split into "
                         f"{microbatches} micro-batches: use at most {rows} micro-batches or "
                         f"a larger batch")
    return bundle.split(batch, microbatches)
