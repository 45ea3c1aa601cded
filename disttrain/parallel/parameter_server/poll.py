"""A tiny cooperative event loop: conversations are generators that yield what they await.

A server talks to W workers at once and a worker to S servers at once, from one thread.
Each conversation (one worker's requests at a server; a worker's requests to one server)
is a generator that yields :class:`Wait` objects, typically "this message has arrived";
:func:`drive` resumes every conversation whose wait is over and sleeps until something
changes.

Why helper threads: Gloo's point-to-point work never reports ``is_completed()`` until
someone calls ``wait()`` on it, and a ``wait(timeout)`` that times out breaks the whole
Gloo context. So a :class:`Watcher` thread blocks in ``wait()`` for each receive in flight
and sets a flag (and wakes the loop) when it returns, with the error if the peer died.
Sends are not watched: a send has completed once the peer answers the message, so it is
collected then (:func:`settle`), without a thread hand-off.
The loop keeps its own deadline per wait (``timeout_s``, shorter than the communicator's),
so a silent peer is reported by role and rank before Gloo's own timeout fires.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from disttrain.comm import CommTimeoutError, Work
from disttrain.parallel.parameter_server.errors import PSPeerFailedError, PSTimeoutError

_IDLE_CHECK_S = 0.1  # a safety net: completions wake the loop at once


class Watch:
    """One message in flight; ``done`` turns True when its ``wait()`` returned or failed."""

    def __init__(self, work: Work, wakeup: threading.Event) -> None:
        self.work, self._wakeup = work, wakeup
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.work.wait()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done = True
            self._wakeup.set()


class Watcher:
    """Daemon threads that block in ``Work.wait()``; one per message in flight at most.

    Threads are reused; a new one starts only when all are busy. They are daemons, so a
    wait that never returns (a peer that died mid-message) cannot keep the process alive."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.wakeup = threading.Event()
        self._queue: queue.SimpleQueue[Watch | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0

    def watch(self, work: Work) -> Watch:
        item = Watch(work, self.wakeup)
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                self._threads += 1
                threading.Thread(target=self._serve, name=f"{self.name}-wait{self._threads}",
                                 daemon=True).start()
        self._queue.put(item)
        return item

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            item.run()
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """Stop the idle threads (busy ones end with their wait)."""
        with self._lock:
            count = self._threads
        for _ in range(count):
            self._queue.put(None)


@dataclass
class Wait:
    """What a conversation waits for; past ``deadline`` (time.monotonic) ``expired()``
    builds the error to raise."""

    ready: Callable[[], bool]
    deadline: float = math.inf
    expired: Callable[[], BaseException] | None = None


Task = Generator[Wait, None, Any]


def on_watch(watch: Watch, timeout_s: float, peer: str, rank: int, doing: str) -> Wait:
    """Wait for a watched message to or from ``peer`` (rank ``rank``) at most ``timeout_s``."""
    return Wait(lambda: watch.done, time.monotonic() + timeout_s,
                lambda: PSTimeoutError(f"{peer} did not answer within {timeout_s:g}s while "
                                       f"{doing}: it died, hangs, or is slower than "
                                       f"timeout_s", rank))


def post(start: Callable[[], Work], peer: str, rank: int, doing: str) -> Work:
    """Start a send or receive; Gloo refuses at once when the peer's connection is closed."""
    try:
        return start()
    except RuntimeError as exc:  # Gloo's error, or the communicator's after an earlier one
        raise PSPeerFailedError(f"{peer} failed: its connection is closed ({doing}); the "
                                f"process most likely died ({exc})", rank) from exc


def settle(sends: list[Work], peer: str, rank: int, doing: str) -> None:
    """Collect sends that must have completed because the peer answered after receiving
    them: their ``wait()`` returns at once, so no watcher thread is spent on them."""
    try:
        for work in sends:
            work.wait()
    except Exception as exc:
        raise PSPeerFailedError(f"{peer} failed: its connection broke ({doing}); the process "
                                f"most likely died ({exc})", rank) from exc
    sends.clear()


def finish(watch: Watch, peer: str, rank: int, doing: str) -> None:
    """Raise the transport's error, if the message failed, as one naming the peer: a broken
    connection as PSPeerFailedError (the peer died), a transport timeout as PSTimeoutError
    (a silent peer is no dead one: nobody may go on without it)."""
    if isinstance(watch.error, CommTimeoutError):
        raise PSTimeoutError(f"{peer} did not answer while {doing}: the transport's own "
                             f"timeout expired ({watch.error})", rank) from watch.error
    if watch.error is not None:
        raise PSPeerFailedError(f"{peer} failed: its connection broke while {doing}; the "
                                f"process most likely died ({watch.error})",
                                rank) from watch.error


def drive(tasks: Sequence[Task], wakeup: threading.Event) -> list[Any]:
    """Run the conversations until all return; returns their return values in order.
    The first error (from a conversation or a deadline) is raised; the others are closed.
    ``wakeup`` is set by the watcher when a message completes."""
    results: list[Any] = [None] * len(tasks)
    current: dict[int, Wait] = {}

    def advance(i: int) -> None:
        try:
            current[i] = next(tasks[i])
        except StopIteration as stop:
            results[i] = stop.value
            current.pop(i, None)

    try:
        for i in range(len(tasks)):
            advance(i)
        while current:
            wakeup.clear()  # before the scan: a completion during it is not lost
            progressed = False
            now = time.monotonic()
            for i, wait in list(current.items()):
                if wait.ready():
                    advance(i)
                    progressed = True
                elif now > wait.deadline:
                    raise wait.expired() if wait.expired is not None else TimeoutError()
            if not progressed:
                nearest = min(w.deadline for w in current.values()) - now
                wakeup.wait(max(0.0, min(_IDLE_CHECK_S, nearest)))
    finally:
        for task in tasks:
            task.close()
    return results
