"""Learning-rate schedules: each step's rate as a pure function of its index, set by the loop.

A schedule is a factor of the base rate for step ``k`` (0-based: the step about to run)::

    factor
    1 ┤        ╭──╮_            linear warmup over ``warmup_steps`` steps, then
      │      ╱      ╲__         constant: stay at 1
      │    ╱            ╲__     linear:   1 → min_lr/lr along a straight line
      │  ╱                  ╲_  cosine:   1 → min_lr/lr along half a cosine
    0 ┼──────────────────────── k
      0   warmup     the rest of the run (its last step is at min_lr exactly)

The conventions are torchtitan's (``lr_scheduler.py``, ``linear_warmup_stable_decay``):
warmup starts from a small fraction, not from 0 (step k < W runs at lr · (k+1)/(W+1), so no
step is wasted at rate 0, unlike DeepSpeed's ``WarmupLR``, whose first step is at
``warmup_min_lr``, 0 by default), and the decay's progress counts the step being taken,
(k+1−W)/(K−W) for K steps in all, so the last step runs at ``min_lr``. ``min_lr`` is an
absolute rate, as Megatron's and DeepSpeed's; every parameter group's own base rate is
scaled by the same factor (torch's ``LambdaLR``), so a group at half the rate stays at half.

Because the rate is a function of the step alone, a run resumed from a checkpoint of step s
continues at exactly the rate step s+1 had in the uninterrupted run: the schedule's state is
its settings (the loop keeps them in the checkpoint's ``meta.pt`` and refuses a resume with
other ones) and the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """The rate of every step of a run of ``total_steps`` steps at base rate ``lr``."""

    name: str = "constant"
    lr: float = 0.05
    warmup_steps: int = 0
    min_lr: float = 0.0  # the rate of the last step (linear, cosine)
    total_steps: int = 1

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(SCHEDULES)}, got "
                             f"{self.name!r}")
        for name in ("warmup_steps", "total_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int ≥ 0, got {value!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be between 0 and lr ({self.lr:g}), got "
                             f"{self.min_lr:g}")

    @property
    def varies(self) -> bool:
        """Whether any step runs at another rate than ``lr``."""
        return self.name != "constant" or self.warmup_steps > 0

    def factor(self, step: int) -> float:
        """The base rate's multiplier for step ``step`` (0-based)."""
        warmup = self.warmup_steps
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if self.name == "constant":
            return 1.0
        decay = max(self.total_steps - warmup, 1)
        progress = min((step + 1 - warmup) / decay, 1.0)
        shape = 1.0 - progress if self.name == "linear" else (
            0.5 * (1.0 + math.cos(math.pi * progress)))
        floor = self.min_lr / self.lr
        return floor + (1.0 - floor) * shape

    def lr_at(self, step: int) -> float:
        """The rate of step ``step`` (0-based) for the base rate ``lr``."""
        return self.lr * self.factor(step)

    def state_dict(self) -> dict[str, Any]:
        """The settings that fix every step's rate (saved with a checkpoint)."""
        return asdict(self)


def rates(schedule: LRSchedule, steps: int | None = None) -> list[float]:
    """The rate of each of the first ``steps`` steps (default: the whole run), as data."""
    return [schedule.lr_at(k) for k in range(schedule.total_steps if steps is None else steps)]


class LRScheduler:
    """Sets each step's rate on the torch optimizers that apply this rank's updates.

    ``optimizers`` is called before every step, since a strategy may replace its optimizer
    (a checkpoint load builds new parameter groups); each group's base rate is the one it
    had when the scheduler was made, before any step or resume."""

    def __init__(self, schedule: LRSchedule,
                 optimizers: Callable[[], Sequence[torch.optim.Optimizer]]) -> None:
        self.schedule, self._optimizers = schedule, optimizers
        self.base: list[list[float]] = [[float(g["lr"]) for g in opt.param_groups]
                                        for opt in optimizers()]

    def set_step(self, step: int) -> float:
        """Set the rate of step ``step`` (0-based) on every group; returns the rate of the
        base ``lr`` (what the metrics line shows)."""
        factor = self.schedule.factor(step)
        optimizers = self._optimizers()
        if len(optimizers) != len(self.base):
            raise RuntimeError(f"the strategy's optimizers changed from {len(self.base)} to "
                               f"{len(optimizers)} during the run")
        for opt, base in zip(optimizers, self.base):
            for group, rate in zip(opt.param_groups, base):
                group["lr"] = rate * factor
        return self.schedule.lr * factor


class _Spec(Protocol):  # a StrategySpec
    @property
    def layout(self) -> str: ...

    @property
    def family(self) -> str | None: ...


class _Stepping(Protocol):
    optimizer: Any  # a Strategy's

    def update_optimizer(self) -> torch.optim.Optimizer | None: ...


def torch_optimizers(strategy: _Stepping) -> list[torch.optim.Optimizer]:
    """The torch optimizers whose parameter groups' rates a schedule sets on this rank of
    ``strategy``: the one applying its update (a ZeRO wrapper's inner one, a pipeline
    stage's own; none on a stage without parameters)."""
    found = strategy.update_optimizer()
    if found is None:  # a ZeRO wrapper inside a tensor-parallel mesh holds it
        inner = getattr(strategy.optimizer, "optimizer", None)
        found = inner if isinstance(inner, torch.optim.Optimizer) else None
    return [] if found is None else [found]


def check_schedule(name: str, spec: _Spec, lr_schedule: str, warmup_steps: int) -> None:
    """Refuse a varying rate for strategy ``name`` where the loop's optimizers do not apply
    the updates: the parameter servers' own, DeepSpeed's engine."""
    if lr_schedule == "constant" and not warmup_steps:
        return
    if spec.layout == "ps":
        raise ValueError(f"--lr-schedule and --warmup-steps do not apply to {name!r}: its "
                         f"servers apply the updates with optimizers of their own, which the "
                         f"loop's schedule does not reach; use --lr-schedule constant")
    if spec.family == "deepspeed":
        raise ValueError(f"--lr-schedule and --warmup-steps do not apply to {name!r}: "
                         f"DeepSpeed's engine steps its optimizer itself; use --lr-schedule "
                         f"constant")
