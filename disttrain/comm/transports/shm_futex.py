"""Sleep until a shared-memory word changes: Linux futexes through ctypes.

A rank that has waited a while for another rank's counter should sleep in the kernel, not
poll: a sleeping process leaves the CPU to the rank it waits for (4 ranks on 2 cores), and
the scheduler runs it as soon as it is woken, even on a busy machine. ``futex(FUTEX_WAIT)``
sleeps only if the 32-bit word still holds the value the caller last saw, and the writer
calls ``futex(FUTEX_WAKE)`` *after* storing the new value, so a wake-up cannot be lost: if
the store came first the wait returns at once, otherwise the wake finds the sleeper.

Counters are int64 on their own cache line; the futex word is their low 32 bits
(little-endian: the first 4 bytes). Futexes on a MAP_SHARED mapping (no FUTEX_PRIVATE_FLAG)
are keyed by the underlying file page, so they work across processes.

Where futexes are unavailable (not Linux, unknown architecture) :func:`wait` sleeps for its
timeout instead and :func:`wake` does nothing: slower, still correct (waits poll).
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time

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
AVAILABLE = _syscall is not None


def wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep until the 32-bit word at ``address`` no longer holds ``seen``'s low 32 bits,
    someone calls :func:`wake` on it, or ``timeout_s`` passes (spurious returns are fine:
    callers re-check their condition)."""
    if _syscall is None:
        time.sleep(timeout_s)
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(seen),  # type: ignore[operator]
             ctypes.byref(ts), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address`` (call after storing to it)."""
    if _syscall is not None:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL,  # type: ignore[operator]
                 None, None, 0)
