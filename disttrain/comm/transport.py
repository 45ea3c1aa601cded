"""The transport interface: how bytes move between two ranks. Algorithms are built on it.

A transport offers only non-blocking point-to-point messages between the ranks of its group
(``isend``/``irecv`` returning a handle with ``wait(timeout_s)``), sub-groups, and, when it
sits on torch.distributed, the process group that the ``native`` algorithm hands whole
collectives to. Everything else (rings, trees, timeouts that name peers, byte counting per
collective) lives above it, so a new transport is a small file.

Contract for ``RawWork.wait(timeout_s)``: return when the transfer completed; raise the
builtin ``TimeoutError`` when it did not within ``timeout_s``; raise ``ConnectionError``
when the peer is gone. ``isend``/``irecv`` may raise the same two when the message cannot
even be posted (Gloo refuses a connection that already broke). The caller turns those into
errors that name the operation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class RawWork(Protocol):
    """A pending transfer. A work whose ``is_completed()`` cannot turn True before
    ``wait()`` was called (Gloo's point-to-point work) has an attribute ``polls = False``;
    :class:`~disttrain.comm.p2p_work.P2PWork` then waits for it on a helper thread."""

    def wait(self, timeout_s: float) -> None: ...

    def is_completed(self) -> bool: ...


class PeerTimeoutError(TimeoutError):
    """A transport's ``TimeoutError`` that names the group rank ``peer`` it waited for."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class PairTimeoutError(PeerTimeoutError):
    """A message whose posting blocked until the timeout: creating the pair's connection
    waits for the peer's first message (NCCL's lazily created communicators)."""


class PeerGoneError(ConnectionError):
    """A transport's ``ConnectionError`` that names the group rank ``peer`` it lost."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class DoneWork:
    """A transfer with nothing to do (zero bytes, or a message to oneself)."""

    def wait(self, timeout_s: float) -> None:
        return None

    def is_completed(self) -> bool:
        return True


WORKLOADS = ("collectives", "p2p")  # what Transport.tune_io may be told


def check_workload(workload: str) -> str:
    """``workload`` if it is one of WORKLOADS, else a ValueError naming the choices."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r} is unknown; choose one of: "
                         f"{', '.join(WORKLOADS)}")
    return workload


class Transport(ABC):
    """Point-to-point messaging among ``world_size`` ranks; ranks are group-relative."""

    name: str = "abstract"

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    @abstractmethod
    def global_ranks(self) -> tuple[int, ...]:
        """The global rank of each group-relative rank."""

    @abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> RawWork:
        """Start sending a contiguous tensor to group rank ``dst``."""

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> RawWork:
        """Start receiving into a contiguous tensor from group rank ``src``."""

    def tune_io(self, workload: str) -> None:
        """Told what this process's communication mostly is (``"collectives"`` or ``"p2p"``),
        a transport may schedule its I/O threads for it; by default nothing changes."""
        return None

    @abstractmethod
    def subgroup(self, ranks: Sequence[int]) -> Transport | None:
        """A transport over group ranks ``ranks`` (called by every member, in the same order
        on every rank); ``None`` on ranks that are not members."""

    @property
    def native_group(self) -> Any | None:
        """The torch.distributed process group for ``native`` collectives, if there is one."""
        return None

    @property
    def device_type(self) -> str:
        """The device type tensors must live on (``cpu`` for Gloo, ``cuda`` for NCCL)."""
        return "cpu"

    @property
    def in_order(self) -> bool:
        """True when the messages between two ranks match in the order they were posted,
        whatever their tags, and each rank's sends and receives to one peer run one after
        the other, each waiting for its match (NCCL; the NCCL-rules test mode). Algorithms
        must then post the messages of a pair in an order both ranks agree on."""
        return False

    @property
    def bound_to_device(self) -> bool:
        """True when every point-to-point message of the group, to any peer, runs on one
        queue in posting order (an NCCL group bound to a device; see
        :mod:`disttrain.comm.nccl_rules`, rule 5)."""
        return False

    def connect(self, peers: Sequence[int]) -> None:
        """Make sure this rank's connections to ``peers`` exist, creating the missing ones
        now, in ascending peer order (blocking until each peer does the same). Transports
        whose pairs are created at their first message (NCCL without a bound device) need
        it before a pattern whose first contacts would form a cycle; every rank of a pair
        must call it. Nothing to do by default: the pairs exist when the group does."""
        return None

    def zeros(self, numel: int, dtype: torch.dtype, only_if_useful: bool = False
              ) -> torch.Tensor:
        """A zero-filled flat tensor for :meth:`Communicator.shared_zeros`: an ordinary one
        here; a transport that reduces tensors where they lie (``shm``) returns one of its
        shared buffers, unless ``only_if_useful`` and ``numel`` elements would not gain."""
        return torch.zeros(numel, dtype=dtype, device=self.device_type)

    def close(self) -> None:
        """Release resources; the transport must not be used afterwards."""
        return None
