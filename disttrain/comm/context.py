"""What an algorithm sees of a collective in flight: its rank, peers, and named, counted P2P.

Every message an algorithm sends goes through :class:`CollectiveContext`, which

* skips zero-byte messages on both sides (both sides know every size, so they agree),
* tags messages by algorithm step, so messages of different steps never mix,
* counts bytes and messages per collective in the transport's :class:`TrafficStats`,
* turns a transport's ``TimeoutError``/``ConnectionError`` into an error that names the
  operation, its sequence number and the peer being waited for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.comm.errors import CommTimeoutError, PeerFailedError
from disttrain.comm.stats import TrafficStats
from disttrain.comm.transport import DoneWork, RawWork, Transport

# Tags at or above this value belong to collectives; user point-to-point tags stay below it.
COLLECTIVE_TAG_BASE = 1 << 24
MAX_USER_TAG = COLLECTIVE_TAG_BASE - 1
_STEP_TAGS = 1 << 12


@dataclass
class Pending:
    """A message in flight, remembering its peer and direction for error messages."""

    raw: RawWork
    peer: int
    kind: str  # "send" or "recv"


class CollectiveContext:
    """One collective call: the algorithm's only door to the network."""

    def __init__(
        self,
        transport: Transport,
        stats: TrafficStats,
        *,
        op: str,
        seq: int,
        algorithm: str,
        timeout_s: float,
        chunk_bytes: int,
        tag_base: int = COLLECTIVE_TAG_BASE,
    ) -> None:
        self.transport = transport
        self.stats = stats
        self.op = op
        self.seq = seq
        self.algorithm = algorithm
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._tag_base = tag_base
        self.rank = transport.rank
        self.world_size = transport.world_size

    @property
    def native_group(self) -> Any:
        return self.transport.native_group

    def _tag(self, step: int) -> int:
        return self._tag_base + (step % _STEP_TAGS)

    def isend(self, tensor: torch.Tensor, peer: int, step: int = 0) -> Pending:
        if tensor.numel() == 0:
            return Pending(DoneWork(), peer, "send")
        self.stats.count_send(self.op, tensor.numel() * tensor.element_size())
        return Pending(self.transport.isend(tensor, peer, self._tag(step)), peer, "send")

    def irecv(self, tensor: torch.Tensor, peer: int, step: int = 0) -> Pending:
        if tensor.numel() == 0:
            return Pending(DoneWork(), peer, "recv")
        self.stats.count_recv(self.op, tensor.numel() * tensor.element_size())
        return Pending(self.transport.irecv(tensor, peer, self._tag(step)), peer, "recv")

    def wait(self, pending: Pending) -> None:
        """Wait for one message; on failure, name the op, its sequence number and the peer."""
        try:
            pending.raw.wait(self.timeout_s)
        except TimeoutError as exc:
            raise CommTimeoutError(
                f"{self.op} #{self.seq} ({self.algorithm}) on rank {self.rank}: timed out after "
                f"{self.timeout_s:g}s waiting to {pending.kind} "
                f"{'to' if pending.kind == 'send' else 'from'} rank {pending.peer}; that rank "
                f"is stuck, dead, or called a different collective ({exc})",
                op=self.op, seq=self.seq, peer=pending.peer,
            ) from exc
        except ConnectionError as exc:
            raise PeerFailedError(
                f"{self.op} #{self.seq} ({self.algorithm}) on rank {self.rank}: rank "
                f"{pending.peer} closed the connection during a {pending.kind} "
                f"(it probably died; see its log) ({exc})",
                op=self.op, seq=self.seq, peer=pending.peer,
            ) from exc

    def wait_all(self, pendings: Iterable[Pending]) -> None:
        for pending in pendings:
            self.wait(pending)

    def send(self, tensor: torch.Tensor, peer: int, step: int = 0) -> None:
        self.wait(self.isend(tensor, peer, step))

    def recv(self, tensor: torch.Tensor, peer: int, step: int = 0) -> None:
        self.wait(self.irecv(tensor, peer, step))

    def sendrecv(
        self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, step: int = 0
    ) -> None:
        """Exchange with two peers at once (both directions of a link busy)."""
        pendings = [self.irecv(recv, src, step), self.isend(send, dst, step)]
        self.wait_all(pendings)
