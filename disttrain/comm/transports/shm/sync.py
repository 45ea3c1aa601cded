"""Waiting on shared memory: futexes, the waiter, and the collective area's barrier.

**Futexes**: sleep until a shared-memory word changes (Linux, through ctypes).

A rank that has waited a while for another rank's counter should sleep in the kernel, not
poll: a sleeping process leaves the CPU to the rank it waits for (4 ranks on 2 cores), and
the scheduler runs it as soon as it is woken, even on a busy machine. ``futex(FUTEX_WAIT)``
sleeps only if the 32-bit word still holds the value the caller last saw, and the writer
calls ``futex(FUTEX_WAKE)`` *after* storing the new value, so a wake-up cannot be lost: if
the store came first the wait returns at once, otherwise the wake finds the sleeper.

Counters are int64 on their own cache line; the futex word is their low 32 bits
(little-endian: the first 4 bytes). Futexes on a MAP_SHARED mapping (no FUTEX_PRIVATE_FLAG)
are keyed by the underlying file page, so they work across processes.

Where futexes are unavailable (not Linux, unknown architecture) :func:`futex_wait` sleeps
for its timeout instead and :func:`futex_wake` does nothing: slower, still correct (waits poll).

**The waiter** (:class:`Waiter`): poll and yield, then sleep; with a deadline and a
liveness watch.

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
runs it when that rank stores and wakes (futexes, above).

Every wait has a deadline (builtin ``TimeoutError``) and, every ``CHECK_S``, checks that the
ranks it waits for are still alive (``ConnectionError``): a SIGKILLed peer is reported by
number within tens of milliseconds instead of after the timeout.

**The collective area** of a segment (:class:`CollectiveArea`): two buffer sets of per-rank
slots and a counter barrier. Whole collectives (``collectives.py``) work in *rounds*. A
round writes into one buffer set, meets the other ranks at one or more barrier *steps*, and
reads what they wrote::

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

import ctypes
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from disttrain.comm.transports.shm.segment import (
    PID,
    START_TIME,
    STATE,
    STATE_ALIVE,
    STATE_CLOSED,
    ShmLayout,
    is_alive,
    process_start_time,
)

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 2**31 - 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98}.get(
    platform.machine().lower())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> object | None:
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall  # releases the GIL while it runs
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()
FUTEX_AVAILABLE = _syscall is not None


def futex_wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep until the 32-bit word at ``address`` no longer holds ``seen``'s low 32 bits,
    someone calls :func:`futex_wake` on it, or ``timeout_s`` passes (spurious returns are fine:
    callers re-check their condition)."""
    if _syscall is None:
        time.sleep(timeout_s)
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(seen),  # type: ignore[operator]
             ctypes.byref(ts), None, 0)


def futex_wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address`` (call after storing to it)."""
    if _syscall is not None:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL,  # type: ignore[operator]
                 None, None, 0)


# --------------------------------------------------------------------- waiting
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
        self._sleep_on = sleep_on if FUTEX_AVAILABLE else None
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
                futex_wait(word[0], word[1], min(SLEEP_S, self._next_check - now))
        else:
            time.sleep(self._sleep)
            self._sleep = min(self._sleep * 2, MAX_SLEEP_S)


# --------------------------------------------------------- the collective area
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
        futex_wake(self._my_word)
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
