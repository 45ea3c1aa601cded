"""Errors of the parameter server; each names the peer by role and rank and what to do."""

from __future__ import annotations

from disttrain.comm import CommError


class PSError(CommError):
    """Something went wrong in a parameter-server job."""


class PSPeerError(PSError):
    """A peer failed; ``rank`` is its rank when known (the message names its role too)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class PSTimeoutError(PSPeerError):
    """A peer did not answer (or, for a server, a worker sent nothing) within the timeout."""


class PSPeerFailedError(PSPeerError):
    """A peer's connection broke (the process most likely died), or a server reported that
    another rank failed."""


class PSRejectedError(PSError):
    """A server rejected a request (the reply carried an error status)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ProtocolError(PSError):
    """A message broke the protocol. ``status`` is the code sent back to the sender."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
