"""Traffic accounting: bytes and messages each rank sent and received, per collective."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class OpTraffic:
    """Counters for one operation name (``all_reduce``, ``send``, ...)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    msgs_sent: int = 0
    msgs_recv: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "calls": self.calls,
            "bytes_sent": self.bytes_sent,
            "bytes_recv": self.bytes_recv,
            "msgs_sent": self.msgs_sent,
            "msgs_recv": self.msgs_recv,
        }


@dataclass
class TrafficStats:
    """Per-rank counters, keyed by operation. Thread-safe: async collectives count from a thread.

    ``native`` collectives are executed inside torch.distributed, where no byte is visible to
    disttrain: they count a call but no bytes (``bytes_unobserved`` records their payload).
    """

    by_op: dict[str, OpTraffic] = field(default_factory=dict)
    bytes_unobserved: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _op(self, op: str) -> OpTraffic:
        entry = self.by_op.get(op)
        if entry is None:
            entry = self.by_op[op] = OpTraffic()
        return entry

    def count_call(self, op: str) -> None:
        with self._lock:
            self._op(op).calls += 1

    def count_send(self, op: str, nbytes: int) -> None:
        with self._lock:
            entry = self._op(op)
            entry.bytes_sent += nbytes
            entry.msgs_sent += 1

    def count_recv(self, op: str, nbytes: int) -> None:
        with self._lock:
            entry = self._op(op)
            entry.bytes_recv += nbytes
            entry.msgs_recv += 1

    def count(self, op: str, sent: int, received: int) -> None:
        """One round of a shared-memory collective: ``sent`` bytes written for others and
        ``received`` bytes read from them, each a message when non-zero (one lock, not two:
        this runs on every small all-reduce)."""
        with self._lock:
            entry = self.by_op.get(op)
            if entry is None:
                entry = self.by_op[op] = OpTraffic()
            if sent:
                entry.bytes_sent += sent
                entry.msgs_sent += 1
            if received:
                entry.bytes_recv += received
                entry.msgs_recv += 1

    def count_unobserved(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_unobserved += nbytes

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return sum(e.bytes_sent for e in self.by_op.values())

    @property
    def bytes_recv(self) -> int:
        with self._lock:
            return sum(e.bytes_recv for e in self.by_op.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A copy of the counters, safe to keep while traffic goes on."""
        with self._lock:
            return {name: e.as_dict() for name, e in self.by_op.items()}

    def reset(self) -> None:
        with self._lock:
            self.by_op.clear()
            self.bytes_unobserved = 0
