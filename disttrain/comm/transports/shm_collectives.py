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
        # arrive[r] is the first int64 of rank r's arrival line. A memoryview of int64 reads
        # and writes one counter in ~0.1 µs (a numpy element access costs several times that).
        self._flags = buf.cast("B").cast("q")
        self._arrive_at = [layout.arrive_line(r) // 8 for r in range(layout.world_size)]
        self._me_at = self._arrive_at[rank]
        self._others_at = [a for r, a in enumerate(self._arrive_at) if r != rank]
        base = u8.data_ptr()
        self._words = [base + layout.arrive_line(r) for r in range(layout.world_size)]
        self._my_word = self._words[rank]
        self._step = 0
        self._round = 0
        self._views: dict[tuple[int, torch.dtype], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._cut: dict[tuple[int, torch.dtype, int], list[torch.Tensor]] = {}

    # ------------------------------------------------------------------ buffers
    def begin_round(self) -> int:
        """Start a round; returns the buffer set (0 or 1) it must write into."""
        self._round += 1
        return self._round % 2

    def slots(self, buffer_set: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's slot in ``buffer_set`` as a flat ``dtype`` tensor (shared memory)."""
        return self._typed(buffer_set, dtype)[1]

    def heads(self, buffer_set: int, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
        """The first ``n`` elements of every rank's slot in ``buffer_set`` (cached: slicing a
        tensor costs more than copying a few KiB, and small all-reduces repeat sizes)."""
        key = (buffer_set, dtype, n)
        cut = self._cut.get(key)
        if cut is None:
            if len(self._cut) >= 64:
                self._cut.clear()
            cut = self._cut[key] = [slot[:n] for slot in self._typed(buffer_set, dtype)[1]]
        return cut

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

    # ------------------------------------------------------------------ agreement
    def declare(self, intent: tuple[int, int, int]) -> None:
        """Publish what this rank's next step belongs to: (shared buffer index + 1 or 0 for
        an ordinary tensor, byte offset, a 48-bit word the caller packs, e.g. size, dtype
        and op), in the words after its arrival counter.
        Stored before the step's counter (x86 TSO keeps the order), so a peer that sees the
        counter sees the intent. Two slots by step parity: a peer reading intents of step v
        may find this rank already declaring for step v + 1, never further (it waits there)."""
        v, (kind, offset, what) = self._step + 1, intent
        at, flags = self._me_at + 1 + 3 * (v % 2), self._flags
        flags[at + 1], flags[at + 2] = kind << 48 | what, offset
        flags[at] = v

    def intents(self) -> list[tuple[int, int, int] | None]:
        """After the step that followed :meth:`declare`: every rank's declared intent, None
        for a rank that declared none at this step (it runs some other collective)."""
        flags, v = self._flags, self._step
        out: list[tuple[int, int, int] | None] = []
        for base in self._arrive_at:
            at = base + 1 + 3 * (v % 2)
            word = flags[at + 1]
            out.append((word >> 48, flags[at + 2], word & (2**48 - 1)) if flags[at] == v
                       else None)
        return out

    # ------------------------------------------------------------------ barrier
    def step(self, timeout_s: float) -> None:
        """Barrier: return once every rank has reached this step. Raises ``ShmPeerTimeout``
        (a TimeoutError) or ``ShmPeerDead`` (a ConnectionError) naming the late rank."""
        self._step += 1
        v = self._step
        flags = self._flags
        flags[self._me_at] = v  # published after this round's slot writes (x86 TSO)
        shm_futex.wake(self._my_word)
        for at in self._others_at:
            if flags[at] < v:
                self._wait(v, timeout_s)
                return

    def _wait(self, v: int, timeout_s: float) -> None:
        flags, arrive_at = self._flags, self._arrive_at

        def laggards() -> list[int]:
            return [r for r, at in enumerate(arrive_at) if flags[at] < v]

        def sleep_on() -> tuple[int, int] | None:
            for r, at in enumerate(arrive_at):
                seen = flags[at]  # read once: sleep on the value that makes r late
                if seen < v:
                    return self._words[r], seen
            return None

        waiter = Waiter(timeout_s, self._peers, laggards, sleep_on)
        for at in self._others_at:
            while flags[at] < v:
                waiter.pause()

    def close(self) -> None:
        self._views.clear()
        self._cut.clear()
        self._flags.release()
