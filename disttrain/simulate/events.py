"""A small discrete-event engine: tasks with durations and dependencies on resources.

A *resource* is anything that does one thing at a time: a device's compute stream, its
network link, a parameter server's NIC. A *task* occupies one resource for a duration and
may start only when every task it depends on has finished::

    compute  | F0 F1 F2 B2 B1 B0 opt |
    link     |          ar(b0)  ar(b1)|      ar(b1) waits for B0 (dependency) and for
                                             ar(b0) (the link is busy)

Each resource picks its next task by one of two policies:

* ``"fifo"`` (a CUDA stream, a single-threaded program, DDP's progress thread): tasks run
  in the order they were added to the resource, each as soon as its dependencies allow;
  a ready task behind an unready one waits.
* ``"ready"`` (a server answering requests): whichever waiting task became ready first
  runs next (ties: the order added).

**Shared cores** (processes of one machine time-sharing its CPUs): ``Simulation(cores=c)``
and resources declared with a ``load`` > 0 (how many cores one of their tasks keeps busy: 1
for a rank, p for a representative standing for p identical ranks). While the running tasks
of such resources add up to a load L > c, each of them advances at c/L of its speed
(processor sharing, as the kernel's scheduler shares cores between runnable processes), so
a task's duration is its work at full speed and its span stretches only while the cores are
oversubscribed. ``cores=0`` (every real cluster: one device per rank) turns this off.
``slowdown`` (≥ 1, measured: :mod:`~disttrain.probe.contention`) is how much slower
each process computes when all cores compute at once than when it runs alone (shared
caches, memory bandwidth, a hypervisor's vCPUs); with k = min(L, c) cores busy, tasks run
a further 1 + (slowdown − 1)·(k − 1)/(c − 1) times slower.

The engine is event-driven (a heap of completion times), so run time grows as
O(T log T) in the number of tasks T (plus, with shared cores, the running shared tasks at
each event); strategies keep T small by simulating a *representative* device when devices
are symmetric (see docs/simulate.md).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

POLICIES = ("fifo", "ready")


@dataclass(frozen=True)
class Span:
    """Where a finished task ran: resource, start and end (seconds), and its kind."""

    name: str
    resource: str
    kind: str
    start: float
    end: float


@dataclass
class _Task:
    index: int
    name: str
    resource: str
    duration: float
    deps: tuple[int, ...]
    kind: str
    cold_s: float = 0.0  # extra when its resource was idle (see Simulation.add)
    cold_after_s: float = 0.0
    waiting: int = 0  # dependencies not finished yet
    ready_at: float = 0.0
    start: float | None = None
    end: float | None = None


@dataclass
class _Resource:
    policy: str
    queue: deque[int] = field(default_factory=deque)  # fifo: every task, in order added
    ready: list[tuple[float, int]] = field(default_factory=list)  # "ready": heap
    busy: bool = False
    busy_time: float = 0.0
    load: float = 0.0  # cores one running task occupies (0: not on the shared cores)
    last_end: float = 0.0  # when its latest task ended (0: the start of the simulation)


class Simulation:
    """Add resources and tasks, then :meth:`run`; tasks must be added after their deps."""

    def __init__(self, cores: float = 0.0, slowdown: float = 1.0) -> None:
        if not cores >= 0:
            raise ValueError(f"cores must be ≥ 0 (0: no shared cores), got {cores!r}")
        if not slowdown >= 1:
            raise ValueError(f"slowdown must be ≥ 1 (1: cores do not slow each other), got "
                             f"{slowdown!r}")
        self.cores, self.slowdown = float(cores), float(slowdown)
        self._tasks: list[_Task] = []
        self._resources: dict[str, _Resource] = {}
        self._children: list[list[int]] = []
        self._shared: dict[int, float] = {}  # running task on the shared cores → work left
        self._load = 0.0  # sum of the loads of the running shared tasks
        self.makespan = 0.0

    def resource(self, name: str, policy: str = "fifo", load: float = 0.0) -> str:
        """Declare a resource (idempotent when policy and load agree); returns its name.
        ``load`` > 0 puts its tasks on the shared cores (see the module docstring)."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not load >= 0:
            raise ValueError(f"resource {name!r}: load must be ≥ 0 cores, got {load!r}")
        known = self._resources.get(name)
        if known is None:
            self._resources[name] = _Resource(policy, load=float(load))
        elif known.policy != policy or known.load != load:
            raise ValueError(f"resource {name!r} already has policy {known.policy!r} and load "
                             f"{known.load}")
        return name

    def add(self, name: str, resource: str, duration: float, deps: tuple[int, ...] = (),
            kind: str = "", *, cold_s: float = 0.0, cold_after_s: float = 0.0) -> int:
        """A task of ``duration`` seconds on ``resource`` after ``deps``; returns its id.

        ``cold_s``: extra seconds the task pays when its resource sat idle before it
        starts, in proportion to the idle time up to ``cold_after_s`` (0: always in full).
        A collective issued after compute pays a wake-up that one queued right behind
        another does not."""
        if resource not in self._resources:
            self.resource(resource)
        if not duration >= 0:
            raise ValueError(f"task {name!r}: duration must be ≥ 0 seconds, got {duration!r}")
        if not (cold_s >= 0 and cold_after_s >= 0):
            raise ValueError(f"task {name!r}: cold_s and cold_after_s must be ≥ 0 seconds, got "
                             f"{cold_s!r} and {cold_after_s!r}")
        index = len(self._tasks)
        for d in deps:
            if not 0 <= d < index:
                raise ValueError(f"task {name!r} depends on unknown task id {d}; add "
                                 f"dependencies first")
        task = _Task(index, name, resource, float(duration), tuple(deps), kind or name,
                     float(cold_s), float(cold_after_s))
        self._tasks.append(task)
        self._children.append([])
        for d in set(deps):
            self._children[d].append(index)
        task.waiting = len(set(deps))
        self._resources[resource].queue.append(index)
        return index

    def __len__(self) -> int:
        return len(self._tasks)

    # ------------------------------------------------------------------ running
    def run(self) -> float:
        """Place every task in time; returns the makespan (the last end)."""
        events: list[tuple[float, int]] = []  # (end time, task) of running tasks
        for task in self._tasks:
            if task.waiting == 0:
                self._become_ready(task, 0.0)
        now = 0.0
        for res in self._resources.values():
            self._dispatch(res, now, events)
        done = 0
        while events or self._shared:
            now, index = self._next_event(now, events)
            task = self._tasks[index]
            res = self._resources[task.resource]
            res.busy = False
            res.last_end = now
            if index in self._shared:
                del self._shared[index]
                self._load -= res.load
                task.end = now
                res.busy_time += now - (task.start or 0.0)
            done += 1
            for child in self._children[index]:
                c = self._tasks[child]
                c.ready_at = max(c.ready_at, now)
                c.waiting -= 1
                if c.waiting == 0:
                    self._become_ready(c, c.ready_at)
                    self._dispatch(self._resources[c.resource], now, events)
            self._dispatch(res, now, events)
        if done != len(self._tasks):
            stuck = [t.name for t in self._tasks if t.end is None][:5]
            raise RuntimeError(f"simulation stalled with {len(self._tasks) - done} tasks "
                               f"unfinished (first: {stuck}); a fifo resource holds a task "
                               f"whose dependency comes later on the same resource")
        self.makespan = now
        return now

    def _rate(self) -> float:
        """Speed of every running shared task: 1, or cores / load when oversubscribed."""
        share = 1.0 if self._load <= self.cores else self.cores / self._load
        if self.slowdown == 1.0 or self.cores <= 1:
            return share
        busy = min(self._load, self.cores)
        return share / (1 + (self.slowdown - 1) * max(0.0, busy - 1) / (self.cores - 1))

    def _next_event(self, now: float, events: list[tuple[float, int]]) -> tuple[float, int]:
        """The next task to finish (a fixed-length one from the heap, or the shared task
        with the least work left), after advancing every shared task to that time."""
        rate = self._rate()
        shared = min(self._shared, key=self._shared.__getitem__) if self._shared else None
        at = now + self._shared[shared] / rate if shared is not None else float("inf")
        if events and events[0][0] < at:
            at, index = heapq.heappop(events)
        else:
            assert shared is not None
            index = shared
        for key in self._shared:
            self._shared[key] = max(0.0, self._shared[key] - (at - now) * rate)
        return at, index

    def _become_ready(self, task: _Task, at: float) -> None:
        task.ready_at = at
        res = self._resources[task.resource]
        if res.policy == "ready":
            heapq.heappush(res.ready, (at, task.index))

    def _dispatch(self, res: _Resource, now: float, events: list[tuple[float, int]]) -> None:
        if res.busy:
            return
        index = self._next(res)
        if index is None:
            return
        task = self._tasks[index]
        task.start = max(now, task.ready_at)
        if task.cold_s:
            idle = task.start - res.last_end
            share = 1.0 if task.cold_after_s <= 0 else min(1.0, idle / task.cold_after_s)
            task.duration += task.cold_s * share
        res.busy = True
        if res.load > 0 and self.cores > 0:  # on the shared cores: its end depends on load
            self._shared[index] = task.duration
            self._load += res.load
            return
        task.end = task.start + task.duration
        res.busy_time += task.duration
        heapq.heappush(events, (task.end, index))

    def _next(self, res: _Resource) -> int | None:
        if res.policy == "fifo":
            if res.queue and self._tasks[res.queue[0]].waiting == 0:
                return res.queue.popleft()
            return None
        if res.ready:
            return heapq.heappop(res.ready)[1]
        return None

    # ------------------------------------------------------------------ results
    def end(self, task: int) -> float:
        """When ``task`` finished (after :meth:`run`)."""
        value = self._tasks[task].end
        if value is None:
            raise RuntimeError("call run() first")
        return value

    def start(self, task: int) -> float:
        value = self._tasks[task].start
        if value is None:
            raise RuntimeError("call run() first")
        return value

    def busy(self, resource: str) -> float:
        """Seconds ``resource`` spent running tasks."""
        return self._resources[resource].busy_time

    def spans(self) -> list[Span]:
        """Every finished task, in the order added."""
        return [Span(t.name, t.resource, t.kind, t.start or 0.0, t.end or 0.0)
                for t in self._tasks]
