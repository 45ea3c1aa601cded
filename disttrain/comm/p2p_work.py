"""The handle of one point-to-point message (``Communicator.isend``/``irecv``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from disttrain.comm.context import CollectiveContext, Pending
from disttrain.comm.errors import CommError
from disttrain.comm.stats import TrafficStats
from disttrain.comm.transport import Transport
from disttrain.comm.work import Work


class P2PWork(Work):
    """``wait()`` blocks until the message moved, naming the peer on failure. A failed
    message may still arrive later, so the failure poisons the communicator (``on_error``):
    its tags must never be reused."""

    def __init__(self, ctx: CollectiveContext, pending: Pending,
                 on_error: Callable[[BaseException], None]) -> None:
        self._ctx, self._pending, self._done = ctx, pending, False
        self._on_error = on_error

    @classmethod
    def start(cls, transport: Transport, stats: TrafficStats, kind: str, flat: torch.Tensor,
              peer: int, tag: int, *, seq: int, timeout_s: float,
              on_error: Callable[[BaseException], None]) -> P2PWork:
        """Post a ``kind`` ("send" or "recv") of ``flat`` with user tag ``tag``."""
        ctx = CollectiveContext(transport, stats, op=kind, seq=seq, algorithm="p2p",
                                timeout_s=timeout_s, chunk_bytes=1, tag_base=tag,
                                probe_posts=False)
        pending = ctx.isend(flat, peer) if kind == "send" else ctx.irecv(flat, peer)
        return cls(ctx, pending, on_error)

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            if timeout is not None:
                self._ctx.timeout_s = timeout
            try:
                self._ctx.wait(self._pending)
            except CommError as exc:
                self._on_error(exc)
                raise
            self._done = True

    def is_completed(self) -> bool:
        return self._done or self._pending.raw.is_completed()
