"""Pipeline schedules as pure data: each stage's ordered list of actions, for GPipe and 1F1B,
and interleaved 1F1B (v chunks per rank) with its own paper simulation.

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

* **Interleaved 1F1B** (Narayanan et al. 2021, below): each rank holds v model chunks and a
  micro-batch goes round the ranks v times; bubble (p − 1)/(v·m + p − 1). Its actions name
  the chunk too (``F3.1``: micro-batch 3 through chunk 1), and its messages wrap from the
  last rank back to the first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule, about one micro-batch (and, interleaved, one of the
    rank's model chunks: chunk 0 is printed without its suffix, ``F3`` is ``F3.0``)."""

    microbatch: int
    chunk: int = 0
    symbol: ClassVar[str] = "?"

    def __str__(self) -> str:
        return f"{self.symbol}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


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
    """Send the micro-batch's output activation to stage s+1 (without waiting; interleaved,
    the last rank sends to rank 0, whose next chunk takes it)."""

    symbol: ClassVar[str] = "sA"


@dataclass(frozen=True)
class RecvAct(Action):
    """Wait for the micro-batch's input activation from stage s−1."""

    symbol: ClassVar[str] = "rA"


@dataclass(frozen=True)
class SendGrad(Action):
    """Send the gradient of the micro-batch's input to stage s−1 (without waiting;
    interleaved, rank 0 sends to the last rank, whose previous chunk takes it)."""

    symbol: ClassVar[str] = "sG"


@dataclass(frozen=True)
class RecvGrad(Action):
    """Wait for the gradient of the micro-batch's output from stage s+1."""

    symbol: ClassVar[str] = "rG"


COMPUTE = (Forward, Backward)


@dataclass(frozen=True)
class Schedule:
    """Every stage's ordered actions for ``num_microbatches`` micro-batches; with
    ``num_chunks`` v > 1, stage (rank) r's chunk c is virtual stage ``c·p + r``."""

    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]
    num_chunks: int = 1

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.num_stages + stage

    def actions(self, stage: int) -> tuple[Action, ...]:
        """All actions of ``stage``, communication included, in execution order."""
        return self.stages[stage]

    def compute(self, stage: int) -> tuple[Action, ...]:
        """Only the forwards and backwards of ``stage``: ``F0 F1 B0 ...``."""
        return tuple(a for a in self.stages[stage] if isinstance(a, COMPUTE))

    def __str__(self) -> str:
        rows = [f"stage {s}: " + " ".join(map(str, self.compute(s)))
                for s in range(self.num_stages)]
        v = f", v={self.num_chunks}" if self.num_chunks > 1 else ""
        return (f"{self.name} (p={self.num_stages}{v}, m={self.num_microbatches})\n"
                + "\n".join(rows))


def _check(num_stages: int, num_microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")


def with_communication(order: Sequence[Action], stage: int, num_stages: int,
                       num_chunks: int = 1) -> tuple[Action, ...]:
    """Insert the messages a compute order implies: receive an input right before its
    forward, send the output right after it; the same for gradients in the other direction.
    The first (virtual) stage receives no activations and the last sends none (it computes
    the loss); each action's chunk c is virtual stage c·p + ``stage`` of p·``num_chunks``."""
    last = num_stages * num_chunks - 1
    out: list[Action] = []
    for action in order:
        mb, c = action.microbatch, action.chunk
        virtual = c * num_stages + stage
        first, final = virtual == 0, virtual == last
        if isinstance(action, Forward):
            out += ([] if first else [RecvAct(mb, c)]) + [action] + (
                [] if final else [SendAct(mb, c)])
        else:
            out += ([] if final else [RecvGrad(mb, c)]) + [action] + (
                [] if first else [SendGrad(mb, c)])
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


def get_schedule(name: str, num_stages: int, num_microbatches: int,
                 num_chunks: int = 1) -> Schedule:
    """The schedule registered as ``name`` for p stages and m micro-batches; with
    ``num_chunks`` v > 1, its interleaved form (``"1f1b"`` only: :func:`interleaved`)."""
    try:
        make = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of: "
                         f"{', '.join(sorted(SCHEDULES))}") from None
    if num_chunks == 1:
        return make(num_stages, num_microbatches)
    if name != "1f1b":
        raise ValueError(f"schedule {name!r} has no interleaved form; virtual stages "
                         f"(num_chunks={num_chunks}) interleave 1f1b")
    return interleaved(num_stages, num_chunks, num_microbatches)


# ----------------------------------------------------------------------
# Interleaved 1F1B (Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on
# GPU Clusters Using Megatron-LM*, §2.2.2) as pure data, with its own paper simulation.
#
# Each of the p ranks holds v *chunks* (model pieces) instead of one stage: the model is cut
# into p·v virtual stages and rank r holds virtual stages r, r + p, r + 2p, …, so a
# micro-batch goes round the ranks v times. A chunk's forward and backward take 1/v of a
# whole stage's, and the pipeline fills and drains in (p − 1) chunk-slots instead of (p − 1)
# stage-slots, which divides the bubble by v:
#
#     bubble = (p − 1) / (v·m + p − 1)
#
# at the price of v times as many messages. The order is Megatron-LM's: the k-th forward of
# a rank runs chunk ``(k // p) % v`` of micro-batch ``(k // (p·v))·p + k % p`` (groups of p
# micro-batches go through chunk 0, then chunk 1, …), backwards visit the chunks in reverse,
# and rank r runs ``2(p − r − 1) + (v − 1)·p`` warm-up forwards before alternating (all of
# them when m = p). m must be a multiple of p.
#
# Its messages wrap from the last rank back to the first (virtual stage p − 1 feeds p), so
# the runtime's links form a ring (:mod:`.link`). :func:`interleaved` writes the messages
# out as a :class:`Schedule` the runtime executes and :mod:`.schedule_check` checks;
# :func:`simulate_interleaved` checks the compute order alone: dependency order, no
# deadlock, every (micro-batch, chunk) once, and the idle time of each rank.

@dataclass(frozen=True)
class ChunkAction:
    """Forward (``"F"``) or backward (``"B"``) of one micro-batch through one chunk."""

    kind: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


@dataclass(frozen=True)
class InterleavedSchedule:
    """Every rank's compute order; rank r's chunk c is virtual stage ``c·p + r``."""

    num_ranks: int
    num_chunks: int
    num_microbatches: int
    ranks: tuple[tuple[ChunkAction, ...], ...]

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.num_ranks + rank

    def __str__(self) -> str:
        head = (f"interleaved 1f1b (p={self.num_ranks}, v={self.num_chunks}, "
                f"m={self.num_microbatches})")
        return "\n".join([head] + [f"rank {r}: " + " ".join(map(str, actions))
                                   for r, actions in enumerate(self.ranks)])


def interleaved_1f1b(num_ranks: int, num_chunks: int, num_microbatches: int
                     ) -> InterleavedSchedule:
    """Megatron-LM's interleaved 1F1B order for p ranks of v chunks and m micro-batches."""
    p, v, m = num_ranks, num_chunks, num_microbatches
    for name, value in (("num_ranks", p), ("num_chunks", v), ("num_microbatches", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
    if m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches round the ranks in groups of "
                         f"p = {p}: use a multiple of {p} micro-batches, not {m}")
    return InterleavedSchedule(p, v, m, tuple(_rank_order(r, p, v, m) for r in range(p)))


def interleaved(num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """Interleaved 1F1B as the runtime runs it: :func:`interleaved_1f1b`'s order on every
    rank with its messages written out (``rA0.1 F0.1 sA0.1``: activations from rank r − 1,
    and on rank 0 from rank p − 1, for chunks c ≥ 1)."""
    order = interleaved_1f1b(num_ranks, num_chunks, num_microbatches)
    stages = tuple(
        with_communication([(Forward if a.kind == "F" else Backward)(a.microbatch, a.chunk)
                            for a in order.ranks[r]], r, num_ranks, num_chunks)
        for r in range(num_ranks))
    return Schedule("interleaved-1f1b", num_ranks, num_microbatches, stages, num_chunks)


def _rank_order(rank: int, p: int, v: int, m: int) -> tuple[ChunkAction, ...]:
    total = m * v

    def nth(kind: str, k: int) -> ChunkAction:
        chunk = (k // p) % v
        return ChunkAction(kind, (k // (p * v)) * p + k % p,
                           chunk if kind == "F" else v - 1 - chunk)

    warmup = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [nth("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [nth("F", warmup + k), nth("B", k)]
    order += [nth("B", k) for k in range(total - warmup, total)]
    return tuple(order)


class InterleavedScheduleError(ValueError):
    """The schedule cannot run: a deadlock, or an action missing or repeated."""


@dataclass(frozen=True)
class InterleavedTimeline:
    """When each rank ran each action (start, end), and the step's length."""

    runs: tuple[tuple[tuple[ChunkAction, float, float], ...], ...]
    makespan: float

    def idle_fraction(self, rank: int) -> float:
        busy = sum(end - start for _, start, end in self.runs[rank])
        return 1.0 - busy / self.makespan


def simulate_interleaved(schedule: InterleavedSchedule, forward: float = 1.0,
                         backward: float = 1.0) -> InterleavedTimeline:
    """Run every rank's list in order with free messages: an action starts when its rank is
    free and its inputs exist (the forward on the previous virtual stage; the backward on
    the next one, or this chunk's own forward on the last virtual stage). A chunk takes
    ``forward / v`` and ``backward / v``. Raises on a deadlock (naming what each rank waits
    for) or a (micro-batch, chunk) run twice or never."""
    p, v, _m = schedule.num_ranks, schedule.num_chunks, schedule.num_microbatches
    _check_complete(schedule)
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) → end
    free, position = [0.0] * p, [0] * p
    runs: list[list[tuple[ChunkAction, float, float]]] = [[] for _ in range(p)]
    while any(position[r] < len(schedule.ranks[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(schedule.ranks[r]):
                action = schedule.ranks[r][position[r]]
                ready = _ready(action, schedule.virtual_stage(r, action.chunk), last, done)
                if ready is None:
                    break
                length = (forward if action.kind == "F" else backward) / v
                start = max(free[r], ready)
                free[r] = start + length
                done[(action.kind, action.microbatch, schedule.virtual_stage(r, action.chunk))] = (
                    free[r])
                runs[r].append((action, start, free[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            waiting = {r: str(schedule.ranks[r][position[r]]) for r in range(p)
                       if position[r] < len(schedule.ranks[r])}
            raise InterleavedScheduleError(f"deadlock: every rank waits (rank: next action) "
                                           f"{waiting}")
    return InterleavedTimeline(tuple(tuple(r) for r in runs), max(free))


def _ready(action: ChunkAction, stage: int, last: int,
           done: dict[tuple[str, int, int], float]) -> float | None:
    """When ``action``'s inputs exist on virtual ``stage`` (None: not yet)."""
    mb = action.microbatch
    if action.kind == "F":
        needs = [] if stage == 0 else [("F", mb, stage - 1)]
    else:
        needs = [("F", mb, stage)] + ([] if stage == last else [("B", mb, stage + 1)])
    times = [done.get(need) for need in needs]
    if any(t is None for t in times):
        return None
    return max((t for t in times if t is not None), default=0.0)


def _check_complete(schedule: InterleavedSchedule) -> None:
    expected = {(kind, mb, c) for kind in "FB" for mb in range(schedule.num_microbatches)
                for c in range(schedule.num_chunks)}
    for r, actions in enumerate(schedule.ranks):
        seen = [(a.kind, a.microbatch, a.chunk) for a in actions]
        if len(seen) != len(set(seen)) or set(seen) != expected:
            extra = sorted(set(seen) - expected)
            missing = sorted(expected - set(seen))
            raise InterleavedScheduleError(
                f"rank {r} must run every (micro-batch, chunk) forward and backward once: "
                f"{len(seen) - len(set(seen))} repeated, missing {missing[:4]}, unknown "
                f"{extra[:4]}")
