"""Run a schedule on paper: a discrete-time simulation that checks it and measures its bubble.

Each stage walks its action list with its own clock. Forward and backward take
``forward_time`` and ``backward_time`` (a chunk of an interleaved schedule 1/v of them: the
same work per rank); messages take no time. The message semantics are the
runtime's: a send is posted and the stage moves on (``isend``); a receive blocks until the
matching message has been sent (and starts no earlier than the send). Messages between two
stages in one direction are delivered in order, so a receive takes the *next* message of
its channel, and a micro-batch number that differs from the expected one is an error
(two stages ordering micro-batches differently would silently pair the wrong tensors).
Interleaved, the channels go round a ring (the last stage's activations feed stage 0's next
chunk) and a message names its receiving chunk too.

The simulation raises :class:`ScheduleError` for

* a forward before its input arrived, a backward before its forward or its gradient,
  a micro-batch computed twice or never, a message sent but never received;
* a deadlock: every unfinished stage blocked on a receive (the error names each stage
  and what it waits for).

For a valid schedule it returns the timeline, from which come the idle (bubble) fraction
per stage and the peak number of micro-batches whose activations a stage holds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from disttrain.parallel.pipeline.schedules import (
    Action,
    Backward,
    Forward,
    RecvAct,
    RecvGrad,
    Schedule,
    SendAct,
    SendGrad,
)


class ScheduleError(ValueError):
    """A schedule that violates a dependency, loses a message or deadlocks."""


@dataclass(frozen=True)
class Slot:
    """A forward or backward placed in time on one stage."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """The timeline of a simulated schedule and what it implies."""

    schedule: Schedule
    slots: tuple[Slot, ...]
    makespan: float
    busy: tuple[float, ...]  # compute time per stage
    peak_in_flight: tuple[int, ...]  # micro-batches forwarded but not yet backwarded

    def idle_fraction(self, stage: int) -> float:
        """The share of the step's makespan that ``stage`` spends not computing."""
        return 1.0 - self.busy[stage] / self.makespan

    @property
    def bubble(self) -> float:
        """Mean idle fraction over stages; (p − 1)/(m + p − 1) for GPipe and 1F1B,
        (p − 1)/(v·m + p − 1) interleaved."""
        p = self.schedule.num_stages
        return sum(self.idle_fraction(s) for s in range(p)) / p


Key = tuple[int, int]  # (micro-batch, chunk)


@dataclass
class _StageState:
    clock: float = 0.0
    pc: int = 0
    received_act: set[Key] = field(default_factory=set)
    received_grad: set[Key] = field(default_factory=set)
    forwarded: set[Key] = field(default_factory=set)
    backwarded: set[Key] = field(default_factory=set)
    in_flight: int = 0
    peak: int = 0


class _Simulation:
    def __init__(self, schedule: Schedule, forward_time: float, backward_time: float) -> None:
        self.schedule = schedule
        self.p, self.v = schedule.num_stages, schedule.num_chunks
        self.last = self.p * self.v - 1  # the last virtual stage
        # a chunk is 1/v of a stage: the same work per rank whatever v
        self.times = {Forward: forward_time / self.v, Backward: backward_time / self.v}
        self.states = [_StageState() for _ in range(self.p)]
        # (src, dst, activation?) → messages in flight as (micro-batch, chunk, time sent)
        self.channels: dict[tuple[int, int, bool], deque[tuple[int, int, float]]] = {}
        self.slots: list[Slot] = []

    def fail(self, stage: int, action: Action, why: str) -> ScheduleError:
        return ScheduleError(f"{self.schedule.name} stage {stage}, action #"
                             f"{self.states[stage].pc} {action}: {why}")

    def step(self, s: int, action: Action) -> bool:
        """Execute ``action`` on stage ``s``; False if it blocks on a receive."""
        st, key = self.states[s], (action.microbatch, action.chunk)
        virtual = self.schedule.virtual_stage(s, action.chunk)
        if isinstance(action, (RecvAct, RecvGrad)):
            return self.receive(s, action)
        if isinstance(action, (SendAct, SendGrad)):
            self.send(s, action)
        elif isinstance(action, Forward):
            if virtual > 0 and key not in st.received_act:
                raise self.fail(s, action, "forward before its input activation was received")
            if key in st.forwarded:
                raise self.fail(s, action, "micro-batch forwarded twice")
            self.compute(s, action)
            st.forwarded.add(key)
            st.in_flight += 1
            st.peak = max(st.peak, st.in_flight)
        elif isinstance(action, Backward):
            if key not in st.forwarded or key in st.backwarded:
                raise self.fail(s, action, "backward without a pending forward of this "
                                           "micro-batch")
            if virtual < self.last and key not in st.received_grad:
                raise self.fail(s, action, "backward before its output gradient was received")
            self.compute(s, action)
            st.backwarded.add(key)
            st.in_flight -= 1
        else:
            raise self.fail(s, action, f"unknown action type {type(action).__name__}")
        return True

    def compute(self, s: int, action: Action) -> None:
        st = self.states[s]
        end = st.clock + self.times[type(action)]
        self.slots.append(Slot(s, action, st.clock, end))
        st.clock = end

    def peer(self, s: int, forward: bool, sending: bool) -> int:
        """The neighbour a message goes to or comes from: the next stage for activations
        sent and gradients received; with chunks, round the ring."""
        other = s + 1 if forward == sending else s - 1
        return other % self.p if self.v > 1 else other

    def send(self, s: int, action: Action) -> None:
        st, key = self.states[s], (action.microbatch, action.chunk)
        forward = isinstance(action, SendAct)
        dst = self.peer(s, forward, sending=True)
        target = self.schedule.virtual_stage(s, action.chunk) + (1 if forward else -1)
        if not 0 <= target <= self.last:
            raise self.fail(s, action, f"there is no stage {target} to send to")
        done = st.forwarded if forward else st.backwarded
        if key not in done:
            raise self.fail(s, action, "sends a result it has not computed yet")
        chunk = target // self.p  # the receiver's chunk
        self.channels.setdefault((s, dst, forward), deque()).append(
            (action.microbatch, chunk, st.clock))

    def receive(self, s: int, action: Action) -> bool:
        st, key = self.states[s], (action.microbatch, action.chunk)
        forward = isinstance(action, RecvAct)
        src = self.peer(s, forward, sending=False)
        source = self.schedule.virtual_stage(s, action.chunk) + (-1 if forward else 1)
        if not 0 <= source <= self.last:
            raise self.fail(s, action, f"there is no stage {source} to receive from")
        channel = self.channels.get((src, s, forward))
        if not channel:
            return False
        mb, chunk, sent_at = channel.popleft()
        if (mb, chunk) != key:
            got = f"{mb}" + (f" for chunk {chunk}" if self.v > 1 else "")
            raise self.fail(s, action, f"the next message from stage {src} carries micro-batch "
                                       f"{got}: the two stages order micro-batches differently")
        (st.received_act if forward else st.received_grad).add(key)
        st.clock = max(st.clock, sent_at)
        return True

    def run(self) -> SimResult:
        pending = True
        while pending:
            progressed, pending = False, False
            for s, st in enumerate(self.states):
                actions = self.schedule.actions(s)
                while st.pc < len(actions) and self.step(s, actions[st.pc]):
                    st.pc += 1
                    progressed = True
                pending = pending or st.pc < len(actions)
            if pending and not progressed:
                raise ScheduleError(f"{self.schedule.name} deadlocks: " + self.blocked())
        self.check_complete()
        busy = tuple(sum(x.end - x.start for x in self.slots if x.stage == s)
                     for s in range(self.p))
        return SimResult(self.schedule, tuple(self.slots), max(x.end for x in self.slots), busy,
                         tuple(st.peak for st in self.states))

    def blocked(self) -> str:
        waits = []
        for s, st in enumerate(self.states):
            actions = self.schedule.actions(s)
            if st.pc < len(actions):
                waits.append(f"stage {s} waits at action #{st.pc} {actions[st.pc]}")
        return "; ".join(waits)

    def check_complete(self) -> None:
        everything = {(mb, c) for mb in range(self.schedule.num_microbatches)
                      for c in range(self.v)}

        def listed(keys: set[Key]) -> list[int] | list[Key]:
            return sorted(keys) if self.v > 1 else sorted(mb for mb, _ in keys)

        for s, st in enumerate(self.states):
            if st.forwarded != everything or st.backwarded != everything:
                raise ScheduleError(
                    f"{self.schedule.name} stage {s} does not run every micro-batch once: "
                    f"forwards {listed(st.forwarded)}, backwards {listed(st.backwarded)}")
        for (src, dst, _), channel in self.channels.items():
            if channel:
                raise ScheduleError(f"{self.schedule.name}: stage {src} sent micro-batches "
                                    f"{[mb for mb, _, _ in channel]} that stage {dst} never "
                                    f"received")


def simulate(schedule: Schedule, forward_time: float = 1.0,
             backward_time: float = 1.0) -> SimResult:
    """Check ``schedule`` and place its forwards and backwards in time (see module doc)."""
    if forward_time <= 0 or backward_time <= 0:
        raise ValueError("forward_time and backward_time must be positive")
    return _Simulation(schedule, forward_time, backward_time).run()


def format_schedule(schedule: Schedule) -> str:
    """A grid with one row per stage and one column per unit time step::

        stage 0 | F0 F1 F2 F3  .  .  . B0 ...

    (forward and backward take one step each; ``.`` is idle time: the bubble)."""
    v = schedule.num_chunks
    result = simulate(schedule, v, v)  # one step per chunk's forward or backward
    width = max(len(str(x.action)) for x in result.slots)
    columns = int(result.makespan)
    grid = [["." for _ in range(columns)] for _ in range(schedule.num_stages)]
    for slot in result.slots:
        grid[slot.stage][int(slot.start)] = str(slot.action)
    chunks = f", v={v}" if v > 1 else ""
    header = (f"{schedule.name}: p={schedule.num_stages}{chunks}, "
              f"m={schedule.num_microbatches}, bubble {result.bubble:.3f}")
    rows = [f"stage {s} | " + " ".join(cell.rjust(width) for cell in row)
            for s, row in enumerate(grid)]
    return "\n".join([header, *rows])
