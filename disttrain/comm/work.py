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
from typing import Any

import torch

from disttrain.comm.errors import CommTimeoutError


class Work:
    """Handle of an asynchronous operation: ``wait()`` blocks until it is done (or raises
    its error); ``is_completed()`` polls."""

    def wait(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError


class StreamFence:
    """The end of a collective's kernels on the stream it ran on. A host that saw the
    collective finish has only seen its kernels *queued*: the ``avg`` division and an
    algorithm's closing copies may still be running on that stream. :meth:`order_current`
    makes the waiter's current stream wait for them (an event, no host wait), so a result
    read on another stream is the final one."""

    def __init__(self) -> None:
        self.event: Any = None

    def record(self, stream: Any) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        self.event = event

    def order_current(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class CompletedWork(Work):
    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class CollectiveWork(Work):
    """A queued collective. ``wait`` gives up only if the progress thread makes no progress
    (no message and no collective completes) for ``timeout`` seconds, by default a few times
    the communicator's timeout: each message inside has its own timeout and raises a precise
    error first, so this is a backstop, and a long collective whose messages keep flowing
    never trips it."""

    def __init__(self, future: Future[None], description: str, executor: ProgressThread,
                 timeout_s: float, *, op: str = "", seq: int = -1,
                 fence: StreamFence | None = None) -> None:
        self._future = future
        self._fence = fence  # CUDA: the waiter's stream must follow the collective's
        self._description = description
        self._executor = executor
        self._timeout_s = timeout_s
        self._op, self._seq = op, seq

    def wait(self, timeout: float | None = None) -> None:
        limit = 3 * self._timeout_s + 1 if timeout is None else timeout
        seen = self._executor.progress()
        while True:
            try:
                self._future.result(timeout=limit)
                if self._fence is not None:
                    self._fence.order_current()
                return
            except FutureTimeout:
                if self._executor.progress() == seen:
                    raise CommTimeoutError(
                        f"{self._description}: no message of any collective completed in "
                        f"{limit:g}s while waiting for it (running: "
                        f"{self._executor.current or 'nothing'})",
                        op=self._op, seq=self._seq,
                    ) from None
                seen = self._executor.progress()

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
        self.beats = 0  # messages completed by the running collective (see ``beat``)
        self.current = ""

    def beat(self) -> None:
        """Called by a running collective whenever one of its messages completes."""
        self.beats += 1

    def progress(self) -> tuple[int, int]:
        return self.completed, self.beats

    def idle(self) -> bool:
        """Nothing queued or running. Read without the lock: only the caller's thread
        increments ``pending``, so a 0 seen here means all its earlier work has finished."""
        return self.pending == 0

    def run(self, task: Callable[[], None], async_op: bool, timeout_s: float, *, op: str,
            seq: int, name: str, fence: StreamFence | None = None) -> CollectiveWork | None:
        """Run collective ``op`` #``seq`` (algorithm ``name``): now, on this thread, when the
        caller waits for it anyway and nothing is queued (the common, cheapest case);
        otherwise queued behind the pending work, so the call order is kept. Returns the
        handle when ``async_op``."""
        if not async_op and self.idle():
            task()
            return None
        description = f"{op} #{seq} ({name})"
        work = CollectiveWork(self.submit(task, description), description, self, timeout_s,
                              op=op, seq=seq, fence=fence)
        if async_op:
            return work
        work.wait()
        return None

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
