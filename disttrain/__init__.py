"""disttrain: distributed deep-learning training for PyTorch, every strategy measured side by side."""

from disttrain.comm import CommConfig, Communicator, ReduceOp

__version__ = "0.1.0"

__all__ = ["CommConfig", "Communicator", "ReduceOp", "__version__"]
