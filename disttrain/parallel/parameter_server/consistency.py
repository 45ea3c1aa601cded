"""Consistency models as pure data: worker clocks, when a read may proceed, staleness counts.

A worker's *clock* counts the steps it has pushed. Updates are grouped by clock: in ``sync``
and ``ssp`` a server sums the gradients of clock c from every worker and applies them as one
averaged update once the slowest worker has finished clock c, so the parameters move in
clock order. What differs is when a worker may *read* (pull) for its next clock c:

    sync (BSP)     all clocks < c are applied           applied ≥ c        (bound 0)
    ssp (bound s)  all clocks < c − s are applied       applied ≥ c − s    (Ho et al., 2013)
    async (ASGD)   always; each worker's step is its own update, applied on arrival

With s = 0, SSP *is* BSP, and a larger s lets fast workers run up to s clocks ahead of the
slowest (Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel
Parameter Server", NIPS 2013). The staleness of an update is the server's parameter version
when the update is applied minus the version the worker read before computing it: always 0
in sync, at most s in ssp, unbounded in async.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping


class ClockTable:
    """One server's record of every worker's clock and of the clocks already applied.

    ``bound`` is 0 (sync), s (ssp) or None (async, where reads never wait and clocks are
    tracked only for checkpoints and reports)."""

    def __init__(self, bound: int | None, workers: int, start: int = 0) -> None:
        self.bound = bound
        self.clocks = [start] * workers  # clocks each worker has finished
        self.applied = start  # clocks 0 … applied − 1 are in the parameters (sync, ssp)
        self.active = set(range(workers))

    def may_read(self, clock: int) -> bool:
        """May a worker at ``clock`` read now?"""
        return self.bound is None or self.applied >= clock - self.bound

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
        if self.bound is None:
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
