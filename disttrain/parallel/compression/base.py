"""The compressor interface: how one bucket of gradients is averaged over ranks.

A :class:`Compressor` plays the role of Horovod's ``Compression`` class or a torch DDP
communication hook: DataParallel hands it a full bucket as soon as the bucket's gradients
are ready, and gets back a handle; ``handle.wait()`` (called at the end of backward, in
bucket order on every rank) leaves the average over ranks in ``bucket.flat``::

    bucket.flat ─▶ start(): compress, launch async collective(s) ─▶ handle
                                   ... backward goes on ...
    handle.wait(): finish collective(s), decompress ─▶ bucket.flat = mean over ranks

Rules every compressor follows, because the Communicator runs collectives in call order:
``start`` and ``wait`` issue the same collectives, with the same sizes, on every rank.
Compressors keep per-bucket state (error feedback, warm starts) keyed by ``bucket.index``:
use one compressor object per model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

from disttrain.comm import Communicator
from disttrain.parallel.buckets import Bucket


class PendingReduction(Protocol):
    """What ``start`` returns; ``wait`` completes the averaging (a comm ``Work`` is one)."""

    def wait(self) -> None: ...


class Compressor(ABC):
    """Averages a bucket over ranks, compressing what goes on the wire."""

    name = "abstract"

    @abstractmethod
    def start(self, bucket: Bucket, comm: Communicator,
              algorithm: str | None) -> PendingReduction:
        """Launch the (asynchronous) reduction of ``bucket.flat``; return its handle."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ThenFinish:
    """Wait for some comm works, then run ``finish`` once (the decompress step)."""

    def __init__(self, works: Sequence[PendingReduction | None],
                 finish: Callable[[], None]) -> None:
        self._works, self._finish, self._done = works, finish, False

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            if work is not None:
                work.wait()
        self._finish()
        self._done = True


class NoCompression(Compressor):
    """Plain all-reduce of the bucket with ``op="avg"``: the division by the world size
    happens on the communicator's progress thread, still overlapped with backward."""

    name = "none"

    def start(self, bucket: Bucket, comm: Communicator,
              algorithm: str | None) -> PendingReduction:
        work = comm.all_reduce(bucket.flat, "avg", algorithm=algorithm, async_op=True)
        assert work is not None  # async_op=True always returns a handle
        return work
