"""What a pipeline is asked to do (:class:`PipelineConfig`) and what one step measured
(:class:`StepStats`), plus the micro-batch split both depend on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disttrain.parallel.pipeline.schedules import SCHEDULES


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline settings; validated on creation. The CLI maps ``--schedule``,
    ``--microbatches``, ``--partition`` and ``--pp`` onto these fields."""

    schedule: str = "1f1b"  # a key of SCHEDULES: "gpipe" or "1f1b"
    microbatches: int = 8  # m: each batch is cut into m micro-batches along dim 0
    partition: str | tuple[int, ...] = "params"  # "params", "time", or layers per stage
    pp_size: int | None = None  # stages per pipeline; None: every rank is a stage (dp = 1)

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


def split_batch(batch: torch.Tensor | None, microbatches: int, what: str) -> list[torch.Tensor]:
    """Cut ``batch`` into ``microbatches`` pieces along dim 0. Sizes differ by at most one
    row when the batch does not divide evenly (the loss weights each piece by its rows)."""
    if not isinstance(batch, torch.Tensor):
        raise ValueError(f"this stage needs the {what} as a tensor, got {type(batch).__name__}")
    rows = batch.shape[0] if batch.dim() else 0
    if rows < microbatches:
        raise ValueError(f"a batch of {rows} samples ({what}) cannot be split into "
                         f"{microbatches} micro-batches: use at most {rows} micro-batches or "
                         f"a larger batch")
    return list(torch.tensor_split(batch, microbatches))
