"""Transports: ways to move bytes between ranks (torch.distributed point-to-point, ...)."""

from disttrain.comm.transports.torch_p2p import TorchTransport

__all__ = ["TorchTransport"]
