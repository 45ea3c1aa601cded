"""disttrain.comm: collectives and the algorithms behind them, over pluggable transports."""

from disttrain.comm.algorithms import ALGORITHMS, COLLECTIVES
from disttrain.comm.communicator import CommConfig, Communicator
from disttrain.comm.cost_model import LinkCosts
from disttrain.comm.errors import CommError, CommTimeoutError, PeerFailedError
from disttrain.comm.ops import ReduceOp
from disttrain.comm.signature import CollectiveMismatchError
from disttrain.comm.stats import TrafficStats
from disttrain.comm.transport import Transport
from disttrain.comm.transports.torch_p2p import TorchTransport
from disttrain.comm.work import Work

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "CollectiveMismatchError",
    "CommConfig",
    "CommError",
    "CommTimeoutError",
    "Communicator",
    "LinkCosts",
    "PeerFailedError",
    "ReduceOp",
    "TorchTransport",
    "TrafficStats",
    "Transport",
    "Work",
]
