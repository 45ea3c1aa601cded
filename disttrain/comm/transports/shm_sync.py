"""Waiting on shared memory: poll and yield, then sleep; with a deadline and a liveness watch.

A rank waits for a counter another rank will bump. Polling must not starve the rank it
waits for when there are more ranks than cores (4 ranks on 2 cores), so every failed poll
hands the core over with ``os.sched_yield()``, and a long wait sleeps::

    main thread, up to YIELD_S    poll, sched_yield(), poll, …   (a yield costs ~0.5 µs when
                                  no other task wants the core, and runs the awaited rank at
                                  once when it shares this core)
    afterwards, or as soon as     sleep on the awaited counter's futex until its writer
    CLOCK_POLLS polls took more   wakes us (≤ SLEEP_S at a time); without futexes,
    than GIVEN_AWAY_S (a yield    time.sleep doubling from 20 µs to MAX_SLEEP_S
    ran another process)
    any other thread              sleeps at once (see below)

Why no pure spin: when the awaited rank shares this core (more ranks than cores, or a busy
machine), a spinning rank burns its time slice while the rank it waits for cannot run.
Measured on this 2-core machine while other jobs ran (a loop of 300 one-shot 4 KiB
all-reduces, 2 ranks, one run after the other): 28-165 µs per call yielding at once,
229-417 µs spinning 100 µs first, 0.98-1.9 ms spinning 1 ms first.

Why other threads sleep at once: between two polls the waiting thread holds the GIL, and
a thread that releases it only for a ``sched_yield`` takes it straight back, so the main
thread (backward hooks, the optimizer, while the communicator's progress thread waits)
would get the GIL only at the interpreter's forced switch, every 5 ms.

The clock is read every ``CLOCK_POLLS`` polls only, so a short wait costs a few memory
loads and syscalls. A sleeping rank leaves the CPU to the rank it waits for, and the kernel
runs it when that rank stores and wakes (``shm_futex.py``).

Every wait has a deadline (builtin ``TimeoutError``) and, every ``CHECK_S``, checks that the
ranks it waits for are still alive (``ConnectionError``): a SIGKILLed peer is reported by
number within tens of milliseconds instead of after the timeout.
"""

from __future__ import annotations

import os
import threading
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

CLOCK_POLLS = 16  # polls between two reads of the clock
YIELD_S = 0.002
GIVEN_AWAY_S = 0.001  # CLOCK_POLLS polls took this long: a yield ran another process
SLEEP_S = 0.005
MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 500e-6
CHECK_S = 0.02

# Where a waiter may sleep: (address of a 32-bit futex word, the value it last saw), or
# None when the awaited condition already changed and it should re-check at once.
SleepOn = Callable[[], "tuple[int, int] | None"]

_sched_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))
_MAIN = threading.main_thread()


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
        self.yield_s = YIELD_S

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


_YIELD, _SLEEP = 1, 2  # the phases of a wait


class Waiter:
    """One wait: call :meth:`pause` each time the awaited condition is still false."""

    __slots__ = ("_deadline", "_laggards", "_looked", "_next_check", "_peers", "_phase",
                 "_polls", "_sleep", "_sleep_on", "_timeout_s", "_yield_until")

    def __init__(self, timeout_s: float, peers: PeerTable,
                 laggards: Callable[[], Sequence[int]], sleep_on: SleepOn | None = None) -> None:
        self._timeout_s = timeout_s
        self._peers = peers
        self._laggards = laggards  # the ranks still awaited (for liveness and the error)
        self._sleep_on = sleep_on if shm_futex.AVAILABLE else None
        self._polls = 0
        self._deadline = 0.0  # 0: the clocks start at the first look at the clock
        self._next_check = self._yield_until = self._looked = 0.0
        self._sleep = MIN_SLEEP_S
        # Only the main thread polls. Any other thread (the communicator's progress thread)
        # sleeps at once: between two polls it holds the GIL, and a thread that releases
        # the GIL only for a moment takes it straight back, so the main thread (backward
        # hooks, the optimizer) would wait for the interpreter's forced switch, 5 ms.
        self._phase = _YIELD if threading.current_thread() is _MAIN else _SLEEP

    def pause(self) -> None:
        self._polls += 1
        phase = self._phase
        if self._polls % CLOCK_POLLS and phase == _YIELD:
            _sched_yield()
            return
        now = time.monotonic()
        if self._deadline == 0.0:
            self._looked = now
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
        if phase == _YIELD and (now >= self._yield_until or now - self._looked > GIVEN_AWAY_S):
            phase = _SLEEP  # waited long, or a yield lost the core to another process
        self._looked = now
        self._phase = phase
        if phase == _YIELD:
            _sched_yield()
        elif phase == _SLEEP:
            self._sleep_briefly(now)

    def _sleep_briefly(self, now: float) -> None:
        if self._sleep_on is not None:
            word = self._sleep_on()
            if word is not None:
                shm_futex.wait(word[0], word[1], min(SLEEP_S, self._next_check - now))
        else:
            time.sleep(self._sleep)
            self._sleep = min(self._sleep * 2, MAX_SLEEP_S)
