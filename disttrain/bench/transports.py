"""Build the Communicator a benchmark rank measures, for a transport named on the command line.

The names are those of :data:`disttrain.comm.transports.TRANSPORTS`; each rank has already
initialized torch.distributed (Gloo), which every transport uses at least for rendezvous.
"""

from __future__ import annotations

from disttrain.comm import CommConfig, Communicator
from disttrain.comm.transports import TRANSPORTS, make_transport


def check_transport(name: str) -> str:
    """``name`` if it is known, else a ValueError listing the known transports."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}")
    return name


def make_communicator(name: str, timeout_s: float) -> Communicator:
    config = CommConfig(timeout_s=timeout_s)
    if check_transport(name) == "torch":
        return Communicator.from_torch(config=config)  # its waits honour timeout_s
    return Communicator(make_transport(name), config)
