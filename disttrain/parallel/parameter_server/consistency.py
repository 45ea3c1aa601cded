"""Consistency models as pure data: worker clocks, when a read may proceed, staleness counts.

A worker's *clock* counts the steps it has pushed: a worker "at clock c" has finished clocks
0 … c − 1 and computes clock c. The modes differ in when a push is applied and when a worker
may *read* (pull) for its clock c; ``slowest`` is the lowest clock of the workers still
training::

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

from collections import Counter
from collections.abc import Iterable, Mapping


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
