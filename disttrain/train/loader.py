"""Loader threads that read the next steps' batches while the current step computes.

    with Prefetcher(jobs, fetch, workers=1, prefetch=2) as batches:
        for batch in batches:          # fetch(job) for each job, in the jobs' order
            step(batch)

Each ``next()`` asks the workers for one more batch and hands out the oldest, so while step
k runs, the batches of steps k + 1 .. k + ``prefetch`` are being read or wait, ready::

    next() for step       0           1      2      3
    asks the workers for  f0 f1 f2    f3     f4     f5        (prefetch 2)
    while step 1 runs, f2 and f3 are read; step 2 finds f2 ready unless reading is slower

The jobs are taken from their iterator on the consumer's thread, in order, so a generator
of sampler positions needs no lock. Workers are threads, not processes: a token file's
windows are gathered by numpy and the built-in tensors by torch, both outside the GIL, and
threads need no pickling and no start-up per epoch. A dataset whose ``__getitem__`` is
Python-heavy (decoding, augmenting) gains less; give it more workers or do that work
ahead of time. A failed read is raised by the ``next()`` that hands out its batch, so the
step that needed it fails with the reader's error; ``close()`` (or leaving the ``with``)
drops the batches not handed out.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Generic, TypeVar

J = TypeVar("J")
T = TypeVar("T")


class Prefetcher(Generic[J, T]):
    """``fetch(job)`` for each of ``jobs``, in order, read by ``workers`` threads up to
    ``prefetch`` batches ahead of the one handed out (``workers=0``: read in ``next()``)."""

    def __init__(self, jobs: Iterable[J], fetch: Callable[[J], T], workers: int = 1,
                 prefetch: int = 2) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be an int ≥ 0, got {workers!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be an int ≥ 1, got {prefetch!r}")
        self._jobs, self._fetch, self.prefetch = iter(jobs), fetch, prefetch
        self._pool = (ThreadPoolExecutor(workers, thread_name_prefix="disttrain-loader")
                      if workers else None)
        self._pending: collections.deque[Future[T]] = collections.deque()
        self._exhausted = False
        self.submitted = 0  # batches asked of the workers so far
        self.waited_s = 0.0  # how long the last next() waited for its batch (or read it)

    def _submit(self) -> None:
        if self._exhausted or self._pool is None:
            return
        try:
            job = next(self._jobs)
        except StopIteration:
            self._exhausted = True
            return
        self._pending.append(self._pool.submit(self._fetch, job))
        self.submitted += 1

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        started = time.perf_counter()
        try:
            if self._pool is None:
                return self._fetch(next(self._jobs))
            while len(self._pending) <= self.prefetch and not self._exhausted:
                self._submit()  # the batch handed out now, and `prefetch` behind it
            if not self._pending:
                raise StopIteration
            return self._pending.popleft().result()
        finally:
            self.waited_s = time.perf_counter() - started

    def close(self) -> None:
        """Stop reading: batches not handed out are dropped, running reads finish."""
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        self._exhausted = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Prefetcher[J, T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
