"""Errors raised by the communication layer, each naming what to fix or who failed."""

from __future__ import annotations


class CommError(RuntimeError):
    """A collective or point-to-point operation failed."""


class CommTimeoutError(CommError):
    """A blocking wait ran past the communicator's timeout.

    The message names the operation, its sequence number on the communicator and the peer
    rank that was being waited for (``peer``), so a stuck job points at its culprit, and
    ``suspects``: the ranks that did not check in after the timeout (stuck elsewhere, or dead;
    empty when that could not be found out).
    """

    def __init__(self, message: str, *, op: str = "", seq: int = -1, peer: int | None = None,
                 suspects: tuple[int, ...] = ()):
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.peer = peer
        self.suspects = suspects


class PeerFailedError(CommError):
    """A peer rank closed its connection or died while this rank was talking to it.

    ``peer`` is the rank that most likely died; ``suspects`` all ranks that did not check
    in after the failure (empty when that could not be found out)."""

    def __init__(self, message: str, *, op: str = "", seq: int = -1, peer: int | None = None,
                 suspects: tuple[int, ...] = ()):
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.peer = peer
        self.suspects = suspects
