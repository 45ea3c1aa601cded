"""Waiting on shared memory: spin, then yield, then sleep; with a deadline and a liveness watch.

A rank waits for a counter another rank will bump. Polling must not starve the rank it
waits for when there are more ranks than cores (4 ranks on 2 cores), so a :class:`Waiter`
backs off in three phases::

    polls 1..spin_polls      pure spin            (the answer usually comes within µs)
    for yield_s              os.sched_yield()     (hand the core to a runnable peer)
    afterwards               sleep on the awaited counter's futex until its writer wakes
                             us (≤ SLEEP_S at a time); without futexes, time.sleep
                             doubling from 20 µs to MAX_SLEEP_S

A sleeping rank leaves the CPU to the rank it waits for, and the kernel runs it as soon as
that rank stores and wakes (``shm_futex.py``), even on a busy machine. When there are more
ranks than CPUs, ``spin_polls`` is a couple of polls and there is no yield phase: the
awaited rank is then probably waiting for this rank's CPU.

Every wait has a deadline (builtin ``TimeoutError``) and, every ``CHECK_S``, checks that the
ranks it waits for are still alive (``ConnectionError``): a SIGKILLed peer is reported by
number within tens of milliseconds instead of after the timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from disttrain.comm.transports import shm_futex
from disttrain.comm.transports.shm_segment import (
    PID,
    START_TIME,
    STATE,
    STATE_ALIVE,
    STATE_CLOSED,
    ShmLayout,
    is_alive,
    process_start_time,
)

SPIN_POLLS = 50
OVERSUBSCRIBED_SPIN_POLLS = 2
YIELD_S = 0.0005
SLEEP_S = 0.005
MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 500e-6
CHECK_S = 0.02

# Where a waiter may sleep: (address of a 32-bit futex word, the value it last saw), or
# None when the awaited condition already changed and it should re-check at once.
SleepOn = Callable[[], "tuple[int, int] | None"]

_sched_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))


def _cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ShmPeerTimeout(TimeoutError):
    """Ranks ``peers`` did not do their part within the timeout."""

    def __init__(self, message: str, peers: Sequence[int]) -> None:
        super().__init__(message)
        self.peers = tuple(peers)
        self.peer = self.peers[0] if self.peers else None


class ShmPeerDead(ConnectionError):
    """Rank ``peer`` died (or closed its transport) while this rank waited for it."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class PeerTable:
    """The per-rank [pid, start time, state] lines: who is alive, checked while waiting."""

    def __init__(self, i64: np.ndarray, layout: ShmLayout, rank: int) -> None:
        self._i64 = i64
        self._layout = layout
        self.rank = rank
        crowded = layout.world_size > _cpus()
        self.spin_polls = OVERSUBSCRIBED_SPIN_POLLS if crowded else SPIN_POLLS
        self.yield_s = 0.0 if crowded else YIELD_S

    def _field(self, rank: int, field: int) -> int:
        return int(self._i64[self._layout.rank_line(rank) // 8 + field])

    def register(self) -> None:
        """Publish this process (pid and start time) and mark it alive."""
        base = self._layout.rank_line(self.rank) // 8
        pid = os.getpid()
        self._i64[base + PID] = pid
        self._i64[base + START_TIME] = process_start_time(pid)
        self._i64[base + STATE] = STATE_ALIVE

    def mark_closed(self) -> None:
        self._i64[self._layout.rank_line(self.rank) // 8 + STATE] = STATE_CLOSED

    def pid(self, rank: int) -> int:
        return self._field(rank, PID)

    def responsive(self, rank: int) -> bool:
        """False when ``rank`` closed its transport or its process is gone."""
        try:
            self.check([rank])
        except ShmPeerDead:
            return False
        return True

    def check(self, ranks: Sequence[int]) -> None:
        """Raise :class:`ShmPeerDead` naming the first of ``ranks`` that is gone."""
        for r in ranks:
            if r == self.rank:
                continue
            state, pid = self._field(r, STATE), self._field(r, PID)
            if state == STATE_CLOSED:
                raise ShmPeerDead(f"rank {r} (pid {pid}) closed its shared-memory transport", r)
            if pid and not is_alive(pid, self._field(r, START_TIME)):
                raise ShmPeerDead(f"rank {r} (pid {pid}) is no longer running", r)


class Waiter:
    """One wait: call :meth:`pause` each time the awaited condition is still false."""

    __slots__ = ("_deadline", "_laggards", "_next_check", "_peers", "_polls", "_sleep",
                 "_sleep_on", "_spin", "_timeout_s", "_yield_until")

    def __init__(self, timeout_s: float, peers: PeerTable,
                 laggards: Callable[[], Sequence[int]], sleep_on: SleepOn | None = None) -> None:
        self._timeout_s = timeout_s
        self._peers = peers
        self._laggards = laggards  # the ranks still awaited (for liveness and the error)
        self._sleep_on = sleep_on if shm_futex.AVAILABLE else None
        self._polls = 0
        self._spin = peers.spin_polls
        self._deadline = 0.0
        self._next_check = 0.0
        self._yield_until = 0.0
        self._sleep = MIN_SLEEP_S

    def pause(self) -> None:
        self._polls += 1
        if self._polls <= self._spin:
            return
        now = time.monotonic()
        if self._polls == self._spin + 1:  # first slow poll: start the clocks
            self._deadline = now + self._timeout_s
            self._next_check = now + CHECK_S
            self._yield_until = now + self._peers.yield_s
        if now >= self._next_check:
            self._next_check = now + CHECK_S
            self._peers.check(self._laggards())
            if now >= self._deadline:
                late = list(self._laggards())
                raise ShmPeerTimeout(
                    f"waited {self._timeout_s:g}s in shared memory for rank(s) {late}", late)
        if now < self._yield_until:
            _sched_yield()
        elif self._sleep_on is not None:
            word = self._sleep_on()
            if word is not None:
                shm_futex.wait(word[0], word[1], min(SLEEP_S, self._next_check - now))
        else:
            time.sleep(self._sleep)
            self._sleep = min(self._sleep * 2, MAX_SLEEP_S)
