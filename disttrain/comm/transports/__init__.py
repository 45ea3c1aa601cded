"""Transports: ways to move bytes between ranks (torch.distributed point-to-point, shared memory).

:func:`make_transport` builds one by name; ``auto`` takes shared memory when every rank of the
group runs on this machine and torch.distributed otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

from disttrain.comm.transport import Transport
from disttrain.comm.transports.shm import SharedMemoryTransport, ShmConfig, ShmUnavailableError
from disttrain.comm.transports.torch_p2p import TorchTransport

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "torch", "shm")


def make_transport(name: str, group: Any | None = None, *, timeout_s: float = 1800.0,
                   shm_config: ShmConfig | None = None) -> Transport:
    """The transport ``name`` over torch.distributed group ``group`` (default: WORLD).

    Collective: every rank of the group must call it with the same arguments. ``auto`` is
    ``shm`` when all ranks share a host (and shared memory works there), else ``torch``;
    every rank reaches the same decision, because the checks behind it are collective.
    ``timeout_s`` bounds the creation of sub-groups (``Communicator.new_group``) and the
    shared-memory transport's set-up exchanges.
    """
    if name == "torch":
        return TorchTransport(group, timeout_s)
    if name == "shm":
        return SharedMemoryTransport(group, shm_config, timeout_s=timeout_s)
    if name == "auto":
        try:
            return SharedMemoryTransport(group, shm_config, timeout_s=timeout_s)
        except ShmUnavailableError as exc:
            log.info("transport auto: using torch.distributed (%s)", exc)
            return TorchTransport(group, timeout_s)
    raise ValueError(f"transport={name!r} is unknown; choose one of: {', '.join(TRANSPORTS)}")


__all__ = [
    "TRANSPORTS",
    "SharedMemoryTransport",
    "ShmConfig",
    "ShmUnavailableError",
    "TorchTransport",
    "make_transport",
]
