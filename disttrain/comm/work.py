"""Work handles and the progress thread that runs asynchronous collectives in call order.

``async_op=True`` queues the collective on one thread per communicator, so collectives run
in exactly the order they were called (the order every rank must agree on), while the
caller goes on computing: this is what lets DDP overlap gradient all-reduce with backward.
Point-to-point and torch.distributed release the GIL while bytes move, so the thread costs
little. A synchronous call runs inline when nothing is queued, and otherwise queues behind
the pending work and waits, so the order is never broken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from queue import SimpleQueue

from disttrain.comm.errors import CommTimeoutError


class Work:
    """Handle of an asynchronous operation: ``wait()`` blocks until it is done (or raises
    its error); ``is_completed()`` polls."""

    def wait(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError


class CompletedWork(Work):
    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class CollectiveWork(Work):
    """A queued collective. ``wait`` gives up only if the progress thread makes no progress
    for ``timeout`` seconds (each message inside has its own timeout, so this is a backstop)."""

    def __init__(self, future: Future[None], description: str, executor: ProgressThread,
                 timeout_s: float) -> None:
        self._future = future
        self._description = description
        self._executor = executor
        self._timeout_s = timeout_s

    def wait(self, timeout: float | None = None) -> None:
        limit = self._timeout_s if timeout is None else timeout
        seen = self._executor.completed
        while True:
            try:
                self._future.result(timeout=limit)
                return
            except FutureTimeout:
                if self._executor.completed == seen:
                    raise CommTimeoutError(
                        f"{self._description}: no collective finished in {limit:g}s while "
                        f"waiting for it (running: {self._executor.current or 'nothing'})",
                        op=self._description,
                    ) from None
                seen = self._executor.completed

    def is_completed(self) -> bool:
        return self._future.done()


class ProgressThread:
    """One daemon thread executing queued callables in FIFO order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: SimpleQueue[tuple[Callable[[], None], Future[None], str] | None] = (
            SimpleQueue())
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.pending = 0
        self.completed = 0
        self.current = ""

    def idle(self) -> bool:
        with self._lock:
            return self.pending == 0

    def submit(self, fn: Callable[[], None], description: str) -> Future[None]:
        future: Future[None] = Future()
        with self._lock:
            self.pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((fn, future, description))
        return future

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future, description = item
            self.current = description
            try:
                fn()
            except BaseException as exc:  # handed to the waiter, never lost
                future.set_exception(exc)
            else:
                future.set_result(None)
            finally:
                self.current = ""
                with self._lock:
                    self.pending -= 1
                    self.completed += 1

    def close(self, timeout_s: float) -> None:
        with self._lock:
            thread = self._thread
            self._thread = None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)
