"""The collective area of a segment: two buffer sets of per-rank slots and a counter barrier.

Whole collectives (``algorithms/shm.py``) work in *rounds*. A round writes into one buffer
set, meets the other ranks at one or more barrier *steps*, and reads what they wrote::

    buffer set 0:  [ slot r0 | slot r1 | … | slot r(p−1) ]   rounds 0, 2, 4, …
    buffer set 1:  [ slot r0 | slot r1 | … | slot r(p−1) ]   rounds 1, 3, 5, …

Why two sets make one barrier per round enough: a rank writes set s in round e only after
passing the (first) step of round e−1, which every rank reaches only after it finished
reading set s in round e−2. Rounds alternate sets across collectives too, so consecutive
collectives need no extra barrier either.

A step is a counter barrier: rank r stores ``arrive[r] = v`` (its own cache line, one
writer, so no atomics), wakes whoever sleeps on that counter, and waits until every
``arrive[i] ≥ v`` (sleeping, after a while, on the first late rank's counter). Every rank
performs the same sequence of steps, so ``v`` is simply this rank's step count.
"""

from __future__ import annotations

import numpy as np
import torch

from disttrain.comm.transports import shm_futex
from disttrain.comm.transports.shm_segment import ShmLayout
from disttrain.comm.transports.shm_sync import PeerTable, Waiter


class CollectiveArea:
    """This rank's view of the collective slots and barrier counters of a segment."""

    def __init__(self, u8: torch.Tensor, buf: memoryview, layout: ShmLayout, rank: int,
                 peers: PeerTable, one_shot_max_bytes: int) -> None:
        self._u8, self._layout, self._peers = u8, layout, peers
        self.rank = rank
        self.world_size = layout.world_size
        self.slot_bytes = layout.slot_bytes
        self.one_shot_max_bytes = one_shot_max_bytes
        # arrive[r] is the first int64 of rank r's arrival line: a strided view of p counters.
        stride = layout.arrive_line(1) - layout.arrive_line(0)  # one rank's lines
        self._arrive: np.ndarray = np.ndarray(
            (layout.world_size,), dtype=np.int64, buffer=buf,
            offset=layout.arrive_line(0), strides=(stride,))
        base = u8.data_ptr()
        self._words = [base + layout.arrive_line(r) for r in range(layout.world_size)]
        self._step = 0
        self._round = 0
        self._views: dict[tuple[int, torch.dtype], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    # ------------------------------------------------------------------ buffers
    def begin_round(self) -> int:
        """Start a round; returns the buffer set (0 or 1) it must write into."""
        self._round += 1
        return self._round % 2

    def slots(self, buffer_set: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's slot in ``buffer_set`` as a flat ``dtype`` tensor (shared memory)."""
        return self._typed(buffer_set, dtype)[1]

    def region(self, buffer_set: int, dtype: torch.dtype) -> torch.Tensor:
        """All p slots of ``buffer_set`` back to back, as one flat ``dtype`` tensor."""
        return self._typed(buffer_set, dtype)[0]

    def _typed(self, buffer_set: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        key = (buffer_set, dtype)
        views = self._views.get(key)
        if views is None:
            start = self._layout.region(buffer_set)
            size = self.world_size * self.slot_bytes
            region = self._u8[start : start + size].view(dtype)
            per = region.numel() // self.world_size
            views = (region, [region[r * per : (r + 1) * per] for r in range(self.world_size)])
            self._views[key] = views
        return views

    # ------------------------------------------------------------------ barrier
    def step(self, timeout_s: float) -> None:
        """Barrier: return once every rank has reached this step. Raises ``ShmPeerTimeout``
        (a TimeoutError) or ``ShmPeerDead`` (a ConnectionError) naming the late rank."""
        self._step += 1
        v = self._step
        arrive = self._arrive
        arrive[self.rank] = v  # published after this round's slot writes (x86 TSO)
        shm_futex.wake(self._words[self.rank])
        if arrive.min() >= v:
            return

        def laggards() -> list[int]:
            return [r for r in range(self.world_size) if arrive[r] < v]

        def sleep_on() -> tuple[int, int] | None:
            for r in range(self.world_size):
                seen = int(arrive[r])  # read once: sleep on the value that makes r late
                if seen < v:
                    return self._words[r], seen
            return None

        waiter = Waiter(timeout_s, self._peers, laggards, sleep_on)
        while arrive.min() < v:
            waiter.pause()

    def close(self) -> None:
        self._views.clear()
        self._arrive = np.zeros(0, dtype=np.int64)
