"""Pipeline schedules as pure data: each stage's ordered list of actions, for GPipe and 1F1B.

A schedule says, for every stage, in which order it runs the forward and backward pass of
each micro-batch, with the messages between neighbouring stages written out::

    stage s:  RecvAct(i) Forward(i) SendAct(i) ... RecvGrad(i) Backward(i) SendGrad(i)

Activations flow to stage s+1, gradients back to stage s−1. The runtime
(:mod:`disttrain.parallel.pipeline.runtime`) only interprets these lists, and
:mod:`~disttrain.parallel.pipeline.schedule_check` checks them without processes (dependency
order, no deadlock, bubble, activations held), the way torchgpipe's ``clock_cycles`` and
torch.distributed.pipelining's ``F0 F1 B0`` actions keep the schedule testable apart from
the engine.

* **GPipe** (Huang et al. 2019): every stage runs all m forwards, then all m backwards.
  Each stage holds the activations of all m micro-batches at the peak.
* **1F1B** / PipeDream-Flush (Narayanan et al. 2021): stage s runs ``p − s − 1`` warm-up
  forwards, then alternates one forward and one backward, then drains the remaining
  backwards. Same bubble as GPipe, but stage s holds at most ``p − s`` micro-batches.

Both have the idle (bubble) fraction (p − 1)/(m + p − 1) when forward and backward take
equal time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule, about one micro-batch."""

    microbatch: int
    symbol: ClassVar[str] = "?"

    def __str__(self) -> str:
        return f"{self.symbol}{self.microbatch}"


@dataclass(frozen=True)
class Forward(Action):
    """Run this stage's layers on the micro-batch (keeping what backward needs)."""

    symbol: ClassVar[str] = "F"


@dataclass(frozen=True)
class Backward(Action):
    """Back-propagate the micro-batch's output gradient through this stage's layers."""

    symbol: ClassVar[str] = "B"


@dataclass(frozen=True)
class SendAct(Action):
    """Send the micro-batch's output activation to stage s+1 (without waiting)."""

    symbol: ClassVar[str] = "sA"


@dataclass(frozen=True)
class RecvAct(Action):
    """Wait for the micro-batch's input activation from stage s−1."""

    symbol: ClassVar[str] = "rA"


@dataclass(frozen=True)
class SendGrad(Action):
    """Send the gradient of the micro-batch's input to stage s−1 (without waiting)."""

    symbol: ClassVar[str] = "sG"


@dataclass(frozen=True)
class RecvGrad(Action):
    """Wait for the gradient of the micro-batch's output from stage s+1."""

    symbol: ClassVar[str] = "rG"


COMPUTE = (Forward, Backward)


@dataclass(frozen=True)
class Schedule:
    """Every stage's ordered actions for ``num_microbatches`` micro-batches."""

    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]

    def actions(self, stage: int) -> tuple[Action, ...]:
        """All actions of ``stage``, communication included, in execution order."""
        return self.stages[stage]

    def compute(self, stage: int) -> tuple[Action, ...]:
        """Only the forwards and backwards of ``stage``: ``F0 F1 B0 ...``."""
        return tuple(a for a in self.stages[stage] if isinstance(a, COMPUTE))

    def __str__(self) -> str:
        rows = [f"stage {s}: " + " ".join(map(str, self.compute(s)))
                for s in range(self.num_stages)]
        return f"{self.name} (p={self.num_stages}, m={self.num_microbatches})\n" + "\n".join(rows)


def _check(num_stages: int, num_microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")


def with_communication(order: list[Action], stage: int, num_stages: int) -> tuple[Action, ...]:
    """Insert the messages a compute order implies: receive an input right before its
    forward, send the output right after it; the same for gradients in the other direction.
    The first stage receives no activations and the last sends none (it computes the loss)."""
    first, last = stage == 0, stage == num_stages - 1
    out: list[Action] = []
    for action in order:
        mb = action.microbatch
        if isinstance(action, Forward):
            out += ([] if first else [RecvAct(mb)]) + [action] + ([] if last else [SendAct(mb)])
        else:
            out += ([] if last else [RecvGrad(mb)]) + [action] + ([] if first else [SendGrad(mb)])
    return tuple(out)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards (in micro-batch order), on every stage."""
    _check(num_stages, num_microbatches)
    m = num_microbatches
    order: list[Action] = [Forward(i) for i in range(m)] + [Backward(i) for i in range(m)]
    stages = tuple(with_communication(order, s, num_stages) for s in range(num_stages))
    return Schedule("gpipe", num_stages, m, stages)


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Stage ``stage``'s compute order under 1F1B: warm-up forwards, one-forward-one-backward
    steady state, cool-down backwards. With m < p the warm-up is all m forwards."""
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    order: list[Action] = [Forward(i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Forward(warmup + i), Backward(i)]
    order += [Backward(i) for i in range(m - warmup, m)]
    return order


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): at most ``p − s`` micro-batches in flight on stage s."""
    _check(num_stages, num_microbatches)
    stages = tuple(
        with_communication(one_f_one_b_order(s, num_stages, num_microbatches), s, num_stages)
        for s in range(num_stages))
    return Schedule("1f1b", num_stages, num_microbatches, stages)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def get_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The schedule registered as ``name`` for p stages and m micro-batches."""
    try:
        make = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of: "
                         f"{', '.join(sorted(SCHEDULES))}") from None
    return make(num_stages, num_microbatches)
