"""The handle of one point-to-point message (``Communicator.isend``/``irecv``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from disttrain.comm.context import CollectiveContext, Pending, describe_wait
from disttrain.comm.errors import CommError, CommTimeoutError
from disttrain.comm.stats import TrafficStats
from disttrain.comm.transport import Transport
from disttrain.comm.work import Work

_BACKSTOP_S = 5.0  # beyond the helper's own timeout and check-in: a wait() that outlives it
log = logging.getLogger(__name__)
_HELPERS: dict[threading.Thread, P2PWork] = {}  # helper threads still waiting


def _pending() -> list[tuple[threading.Thread, P2PWork]]:
    return [(t, w) for t, w in list(_HELPERS.items()) if t.is_alive()]


def polled_messages() -> int:
    """How many polled point-to-point messages are still in flight (each with a helper
    thread): what :func:`wait_polled_messages` would wait for."""
    return len(_pending())


def _warn(pending: list[tuple[threading.Thread, P2PWork]], what: str) -> None:
    limit = max(w._ctx.timeout_s for _, w in pending)
    log.warning("rank %d %s with %d polled point-to-point message(s) unfinished (%s): "
                "waiting until the peer takes them or exits, at most %gs",
                pending[0][1]._ctx.rank, what, len(pending),
                ", ".join(w.describe() for _, w in pending), limit)


def _warn_pending_at_exit() -> None:
    """Before the interpreter joins the helper threads: say which messages it waits for."""
    pending = _pending()
    if pending:
        _warn(pending, "exits")


def wait_polled_messages() -> None:
    """Before the process group goes (``disttrain.shutdown()``): wait for every polled
    message still in flight, as the exit does, after the same warning. Each helper thread
    ends when the peer takes its message, exits, or the communicator's timeout passes; a
    group destroyed under a waiting send would drop the message."""
    pending = _pending()
    if pending:
        _warn(pending, "leaves the process group")
        deadline = time.monotonic() + max(w._ctx.timeout_s for _, w in pending) + _BACKSTOP_S
        for thread, _ in pending:  # each helper is bounded by its timeout; so is this wait
            thread.join(max(0.0, deadline - time.monotonic()))


# threading's own exit hook runs before non-daemon threads are joined (Python ≥ 3.9)
getattr(threading, "_register_atexit", lambda _f: None)(_warn_pending_at_exit)


class P2PWork(Work):
    """``wait()`` blocks until the message moved, naming the peer on failure. A failed
    message may still arrive later, so the failure poisons the communicator (``on_error``):
    its tags must never be reused.

    ``is_completed()`` polls. Gloo's point-to-point work does not turn complete before
    someone waits on it, so for such a transfer the first poll starts a thread that waits
    for it (under the communicator's timeout) and records how it ended; ``wait()`` then
    waits for that thread and raises what it met. The thread is joined at exit, after a
    warning that names the message (:func:`_warn_pending_at_exit`)."""

    def __init__(self, ctx: CollectiveContext, pending: Pending,
                 on_error: Callable[[BaseException], None]) -> None:
        self._ctx, self._pending, self._done = ctx, pending, False
        self._on_error = on_error
        self._lock = threading.Lock()
        self._ended: threading.Event | None = None  # set by the helper thread, if any
        self._error: BaseException | None = None

    @classmethod
    def start(cls, transport: Transport, stats: TrafficStats, kind: str, flat: torch.Tensor,
              peer: int, tag: int, *, seq: int, timeout_s: float,
              on_error: Callable[[BaseException], None], check_in: bool = True,
              counted: int | None = None) -> P2PWork:
        """Post a ``kind`` ("send" or "recv") of ``flat`` with user tag ``tag``; a failed
        wait asks who else is still there first only with ``check_in``; a receive counts
        ``counted`` bytes where given (a buffer posted larger than the message)."""
        ctx = CollectiveContext(transport, stats, op=kind, seq=seq, algorithm="p2p",
                                timeout_s=timeout_s, chunk_bytes=1, tag_base=tag,
                                probe_posts=False, probe_waits=check_in)
        pending = (ctx.isend(flat, peer) if kind == "send"
                   else ctx.irecv(flat, peer, counted=counted))
        return cls(ctx, pending, on_error)

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        with self._lock:
            ended = self._ended
            if ended is None and timeout is not None:
                self._ctx.timeout_s = timeout
        if ended is not None:
            self._wait_helper(ended, timeout)
            return
        try:
            self._ctx.wait(self._pending)
        except CommError as exc:
            self._on_error(exc)
            raise
        self._done = True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if getattr(self._pending.raw, "polls", True):
            return bool(self._pending.raw.is_completed())
        with self._lock:
            if self._ended is None:
                self._ended = threading.Event()
                # not a daemon: a daemon thread whose wait returns while the interpreter
                # finalizes (the peer exits too) aborts the process ("terminate called
                # without an active exception"); a pending one is joined at exit instead,
                # which the peer's exit or the communicator's timeout ends
                helper = threading.Thread(target=self._help, args=(self._ended,),
                                          name=f"disttrain-{self._ctx.op}-wait")
                _HELPERS[helper] = self
                helper.start()
            return self._ended.is_set()

    def _help(self, ended: threading.Event) -> None:
        try:
            self._ctx.wait(self._pending)
        except BaseException as exc:  # CommError, or anything else: wait() raises it
            self._error = exc
            if isinstance(exc, CommError):
                self._on_error(exc)  # at once: a poller may never call wait()
        finally:
            ended.set()
            _HELPERS.pop(threading.current_thread(), None)

    def describe(self) -> str:
        """``recv #3 from rank 0`` (for the exit warning)."""
        ctx, pending = self._ctx, self._pending
        way = "to" if pending.kind == "send" else "from"
        return f"{ctx.op} #{ctx.seq} {way} rank {pending.peer}"

    def _wait_helper(self, ended: threading.Event, timeout: float | None) -> None:
        """Wait for the helper thread: at most ``timeout``, or its own limit (the
        communicator's timeout and the survivors' check-in) and a little more."""
        limit = timeout if timeout is not None else self._ctx.longest_wait_s + _BACKSTOP_S
        if not ended.wait(limit):
            ctx, pending = self._ctx, self._pending
            exc = CommTimeoutError(
                f"{ctx.op} #{ctx.seq} ({ctx.algorithm}) on rank {ctx.rank}: timed out after "
                f"{limit:g}s {describe_wait('waiting', pending.kind, pending.peer)}; the message "
                f"may still move later, so this communicator can no longer be used",
                op=ctx.op, seq=ctx.seq, peer=pending.peer)
            self._on_error(exc)
            raise exc
        if self._error is not None:
            raise self._error
        self._done = True
