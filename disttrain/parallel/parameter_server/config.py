"""PSConfig, the options every server and worker of one job share, and the consistency
models they select: worker clocks, when a read may proceed, how stale an update was.

Servers and workers must be built with equal configs (the HELLO handshake compares a
fingerprint of the mode, the bound and the key layout and rejects a worker that differs).

A worker's *clock* counts the steps it has pushed: a worker "at clock c" has finished clocks
0 … c − 1 and computes clock c. The modes differ in when a push is applied and when a worker
may *read* (pull) for its clock c; ``slowest`` is the lowest clock of the workers still
training (:class:`ClockTable`)::

    mode           a push is applied                       a read for clock c waits until
    sync (BSP)     with the other W − 1 of its clock, as   slowest ≥ c      (bound 0)
                   one averaged update, in clock order
    ssp, s = 0     exactly as sync (SSP(0) *is* BSP)        slowest ≥ c
    ssp, s > 0     on arrival, alone (like async)           slowest ≥ c − s  (Ho et al., 2013)
    async (ASGD)   on arrival, alone                        never waits

SSP is Ho et al.'s "Stale Synchronous Parallel" ("More Effective Distributed ML via a Stale
Synchronous Parallel Parameter Server", NIPS 2013): a read for clock c is guaranteed to
contain every update of clocks ≤ c − s − 1 from every worker, and it also contains every
update that has arrived since (a worker's own previous clock included: read-my-writes).
So a fast worker runs at most s clocks ahead of the slowest, and without stragglers the
gate never closes and SSP trains like async. Updates are applied on arrival, not
clock-ordered and averaged like sync: that would hide arrived updates, so workers would
drift to the bound and compute on parameters s whole steps old, which with momentum costs
20 accuracy points on digits (docs/parameter_server.md, "Why SSP applies on arrival").

**Staleness** of an update (what :class:`StalenessHistogram` counts, per server): the
server's parameter version when the update is applied minus the version the worker read
before computing it, i.e. how many updates landed in between. A version is one applied
update: one per clock in sync (so staleness is always 0), one per worker push in async and
ssp with s > 0. Bounds: 0 in sync; in ssp with s > 0 at most (W − 1)·(2s + 1), because
between a worker's read for clock c and its push, each other worker can apply only its
clocks c − s … c + s (the read already held its clocks < c − s, and reading for clock
c + s + 1 needs this worker past clock c); unbounded in async.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from disttrain.parallel.parameter_server.partition import Partition

MODES = ("sync", "async", "ssp")
# how an update's learning rate depends on its staleness τ (:func:`staleness_lr_factor`)
STALENESS_LR = ("inverse", "none")


@dataclass(frozen=True)
class PSConfig:
    """How a parameter-server job trains.

    * ``mode``: ``sync`` (BSP: every clock waits for every worker), ``async`` (ASGD: every
      worker step is applied when it arrives) or ``ssp`` (stale synchronous parallel: steps
      are applied on arrival as in async, but a worker may run at most ``staleness`` clocks
      ahead of the slowest; ``staleness=0`` is sync). See :class:`ClockTable`, below.
    * ``sparse_params``: names (``model.named_parameters()``) of embedding tables whose rows
      travel sparsely: a worker pulls and pushes only the rows a batch touches.
    * ``timeout_s``: every wait gives up after this long; a server declares a worker dead when
      it has sent nothing for this long (call :meth:`PSWorker.heartbeat` in longer pauses).
      None: 90% of the communicator's timeout. It must stay below the communicator's
      timeout, because Gloo breaks every connection of the process when its own fires.
      Start-up (a worker's HELLO, the server waiting for it) may take up to 90% of the
      communicator's timeout whatever this is: loading a model or checkpoint takes time.
    * ``max_message_elems``: the largest payload a server accepts in one message.
    * ``staleness_lr``: how an applied update's learning rate depends on its staleness τ
      (parameter versions applied between the pull it was computed on and its own):
      ``inverse`` (default) divides it by τ when τ ≥ 1, the staleness-aware rule of Zhang
      et al. 2016 ("Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI),
      which keeps a late gradient from undoing the steps taken since it was computed;
      ``none`` applies every update at the optimizer's rate. Synchronous clocks have τ = 0
      and are never scaled. Only the servers apply it; workers need not agree.
    * ``straggler``: ``{worker rank: factor}`` slows those workers' steps to ``factor`` × their
      own work (compute, pull and push; sleeping the difference before each push) for
      straggler experiments.
    * ``straggler_every``: None (default) keeps each straggler slow for the whole run. An int
      n makes the slow-downs *transient*: each one starts on its rank and moves to the next
      worker every n clocks, wrapping around, so every worker is slow now and then (the
      jitter SSP is meant to absorb; see :meth:`straggler_factor`).
    """

    mode: str = "sync"
    staleness: int = 2  # ssp only
    sparse_params: tuple[str, ...] = ()
    timeout_s: float | None = None
    max_message_elems: int = 1 << 26
    staleness_lr: str = "inverse"
    straggler: Mapping[int, float] = field(default_factory=dict)
    straggler_every: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is unknown; choose one of {', '.join(MODES)}")
        if not _is_int(self.staleness) or self.staleness < 0:
            raise ValueError(f"staleness must be an int ≥ 0 (clocks a worker may run ahead of "
                             f"the slowest in ssp mode), got {self.staleness!r}")
        names = tuple(self.sparse_params)
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"sparse_params must be distinct parameter names, got "
                             f"{self.sparse_params!r}")
        object.__setattr__(self, "sparse_params", names)
        if self.timeout_s is not None and (not _is_number(self.timeout_s)
                                           or not 0 < self.timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive, finite number of seconds (or "
                             f"None), got {self.timeout_s!r}")
        if not _is_int(self.max_message_elems) or self.max_message_elems < 1:
            raise ValueError(f"max_message_elems must be an int ≥ 1, "
                             f"got {self.max_message_elems!r}")
        if self.staleness_lr not in STALENESS_LR:
            raise ValueError(f"staleness_lr={self.staleness_lr!r} is unknown; choose one of "
                             f"{', '.join(STALENESS_LR)}")
        object.__setattr__(self, "straggler", _check_straggler(self.straggler))
        _check_every(self.straggler_every, self.straggler)

    @property
    def bound(self) -> int | None:
        """How many clocks a worker may be ahead of the slowest: 0 (sync), s (ssp), None."""
        if self.mode == "async":
            return None
        return 0 if self.mode == "sync" else self.staleness

    @property
    def on_arrival(self) -> bool:
        """Is each worker's push its own update, applied when it arrives (async, ssp with
        s > 0)? Otherwise (sync, ssp with s = 0, which is BSP) the W pushes of a clock are
        averaged into one update. Applied on arrival, W updates make one synchronous step:
        give the servers the learning rate divided by W for ``lr`` to mean the same."""
        return self.mode == "async" or (self.mode == "ssp" and self.staleness > 0)

    def fingerprint(self, part: Partition) -> int:
        """What servers and workers must agree on: the key layout, the mode and its bound."""
        return part.fingerprint(f"{self.mode}/{self.bound}")

    def resolve_timeout(self, comm_timeout_s: float) -> float:
        """The timeout to use with a communicator whose own timeout is ``comm_timeout_s``."""
        if self.timeout_s is None:
            return 0.9 * comm_timeout_s
        if self.timeout_s >= comm_timeout_s:
            raise ValueError(f"PSConfig.timeout_s={self.timeout_s:g} must be below the "
                             f"communicator's timeout_s={comm_timeout_s:g}: when Gloo's timeout "
                             f"fires first it breaks every connection of the process. Lower "
                             f"PSConfig.timeout_s or raise CommConfig.timeout_s")
        return self.timeout_s

    @staticmethod
    def startup_timeout(comm_timeout_s: float) -> float:
        """How long HELLO may take: servers may be slow to build the model or restore."""
        return 0.9 * comm_timeout_s

    def straggler_factor(self, rank: int, clock: int = 0, workers: int = 1) -> float:
        """How much slower worker ``rank`` (workers are ranks 0 … W − 1) is at ``clock``.
        Persistent (``straggler_every`` None): its factor, at every clock. Rotating: the
        slow-down that starts on rank r is on worker (r + clock // n) mod W at ``clock``, so
        with n = 5 and W = 2, ``{1: 2.0}`` slows worker 1 on clocks 0-4, worker 0 on 5-9, …
        Workers count their own clocks, so in sync mode exactly one worker per straggler is
        slow at each clock, and in async/ssp a worker is slow on its own clocks."""
        if self.straggler_every is None:
            return self.straggler.get(rank, 1.0)
        shift = clock // self.straggler_every
        for start, factor in self.straggler.items():
            if (start + shift) % workers == rank:
                return factor
        return 1.0


def staleness_lr_factor(rule: str, staleness: list[int]) -> float:
    """The factor on the learning rate of an update whose contributions have these
    stalenesses: ``inverse`` 1/τ̄ for the mean τ̄ ≥ 1 (1 for fresh updates), ``none`` 1."""
    if rule == "none" or not staleness:
        return 1.0
    mean = sum(staleness) / len(staleness)
    return 1.0 / mean if mean > 1.0 else 1.0


class StragglerSpec(NamedTuple):
    """A parsed ``--straggler`` flag: ``PSConfig(straggler=factors, straggler_every=every)``."""

    factors: dict[int, float]
    every: int | None


def parse_straggler(text: str) -> dict[int, float]:
    """``"3:2"`` or ``"3:2,4:1.5"`` (the ``--straggler RANK:FACTOR`` flag) → ``{3: 2.0, …}``.
    The rotating form ``RANK:FACTOR:EVERY`` needs :func:`parse_straggler_spec`."""
    spec = parse_straggler_spec(text)
    if spec.every is not None:
        raise ValueError(f"straggler {text!r} rotates (RANK:FACTOR:EVERY); parse it with "
                         f"parse_straggler_spec, which also returns EVERY")
    return spec.factors


def parse_straggler_spec(text: str) -> StragglerSpec:
    """The ``--straggler`` flag, comma-separated items of one form:

    * ``RANK:FACTOR`` (``"1:2"``, ``"1:2,3:1.5"``): worker RANK is FACTOR× slower all run;
    * ``RANK:FACTOR:EVERY`` (``"1:2:5"``): a FACTOR× slow-down that starts on worker RANK and
      moves to the next worker every EVERY steps (see :meth:`PSConfig.straggler_factor`).
      Several items must share one EVERY.
    """
    result: dict[int, float] = {}
    everys: set[int | None] = set()
    for item in (part.strip() for part in text.split(",")):
        fields = item.split(":")
        try:
            if len(fields) not in (2, 3):
                raise ValueError
            rank, factor = int(fields[0]), float(fields[1])
            every = int(fields[2]) if len(fields) == 3 else None
        except ValueError:
            raise ValueError(f"straggler {item!r} is not RANK:FACTOR or RANK:FACTOR:EVERY "
                             f"(e.g. '3:2' slows rank 3 to twice its compute time; '3:2:5' "
                             f"starts that slow-down on rank 3 and moves it to the next "
                             f"worker every 5 steps)") from None
        if rank in result:
            raise ValueError(f"straggler rank {rank} is given twice in {text!r}")
        result[rank] = factor
        everys.add(every)
    if len(everys) > 1:
        raise ValueError(f"straggler items in {text!r} mix EVERY values {sorted(everys, key=str)}"
                         f"; give every item the same RANK:FACTOR:EVERY period, or none")
    every = everys.pop()
    factors = _check_straggler(result)
    _check_every(every, factors)
    return StragglerSpec(factors, every)


def _check_straggler(value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise ValueError(f"straggler must be a mapping {{rank: factor}}, got {value!r}")
    checked: dict[int, float] = {}
    for rank, factor in value.items():
        if not _is_int(rank) or rank < 0:
            raise ValueError(f"straggler rank must be an int ≥ 0, got {rank!r}")
        if not _is_number(factor) or not 1.0 <= factor < math.inf:
            raise ValueError(f"straggler factor for rank {rank} must be a finite number ≥ 1 "
                             f"(2 = twice as slow), got {factor!r}")
        checked[rank] = float(factor)
    return checked


def _check_every(every: Any, straggler: Mapping[int, float]) -> None:
    if every is None:
        return
    if not _is_int(every) or every < 1:
        raise ValueError(f"straggler_every (the EVERY of RANK:FACTOR:EVERY) must be an int ≥ 1 "
                         f"(steps before the slow-down moves to the next worker), got {every!r}")
    if not straggler:
        raise ValueError("straggler_every is set but no straggler is: give the rank and factor "
                         "the rotating slow-down starts with")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ----------------------------------------------------------------------
# Consistency models as pure data: worker clocks, when a read may proceed, staleness counts.

class ClockTable:
    """One server's record of every worker's clock and of the clocks already applied.

    ``bound`` is 0 (sync), s (ssp) or None (async: reads never wait, and clocks are tracked
    only for checkpoints and reports). ``on_arrival``: each push is its own update, applied
    when it arrives (async, ssp with s > 0), so :meth:`finish` never returns clocks to apply;
    otherwise (sync, ssp with s = 0) a clock is applied once every active worker finished it.
    """

    def __init__(self, bound: int | None, workers: int, start: int = 0, *,
                 on_arrival: bool = False) -> None:
        self.bound = bound
        self.on_arrival = on_arrival or bound is None
        self.clocks = [start] * workers  # clocks each worker has finished
        self.applied = start  # clock-ordered modes: clocks 0 … applied − 1 are applied
        self.active = set(range(workers))

    def may_read(self, clock: int) -> bool:
        """May a worker at ``clock`` read now? When every active worker has finished clock
        c − bound − 1 (in clock-ordered modes ``applied`` equals ``slowest``, so the read
        then holds every clock < c − bound)."""
        return self.bound is None or self.slowest >= clock - self.bound

    def finish(self, worker: int) -> list[int]:
        """Worker ``worker`` finished its clock; returns the clocks that are now complete
        (every active worker finished them) and must be applied, in order."""
        self.clocks[worker] += 1
        return self._complete()

    def leave(self, worker: int) -> list[int]:
        """Worker ``worker`` is done: nobody waits for it any more."""
        self.active.discard(worker)
        return self._complete()

    @property
    def slowest(self) -> int:
        live = [self.clocks[w] for w in self.active]
        return min(live) if live else max(self.clocks, default=self.applied)

    def _complete(self) -> list[int]:
        if self.on_arrival:
            return []
        done = list(range(self.applied, self.slowest))
        self.applied = max(self.applied, self.slowest)
        return done


class StalenessHistogram:
    """How many applied updates had each staleness (in parameter versions)."""

    def __init__(self, counts: Mapping[int, int] | None = None) -> None:
        self.counts: Counter[int] = Counter(counts or {})

    def add(self, staleness: int, times: int = 1) -> None:
        self.counts[staleness] += times

    def merge(self, others: Iterable[StalenessHistogram]) -> StalenessHistogram:
        merged = StalenessHistogram(self.counts)
        for other in others:
            merged.counts.update(other.counts)
        return merged

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def max(self) -> int:
        return max(self.counts, default=0)

    @property
    def mean(self) -> float:
        return sum(s * n for s, n in self.counts.items()) / self.total if self.total else 0.0

    def as_dict(self) -> dict[int, int]:
        return dict(sorted(self.counts.items()))

    def __str__(self) -> str:
        if not self.total:
            return "no updates"
        parts = [f"{s}: {n} ({100 * n / self.total:.0f}%)" for s, n in self.as_dict().items()]
        return f"staleness {', '.join(parts)}; mean {self.mean:.2f}, max {self.max}"
