"""disttrain: distributed deep-learning training for PyTorch, every strategy measured."""

from disttrain import deprecated
from disttrain.comm import CommConfig, Communicator, ReduceOp
from disttrain.comm.monitored_barrier import monitored_barrier
from disttrain.launch import init, shutdown
from disttrain.train.clipping import clip_grad_norm_, clip_on_step

__version__ = "0.1.0"

deprecated.install()  # moved modules answer to their old names (disttrain.deprecated)

__all__ = [
    "CommConfig",
    "Communicator",
    "ReduceOp",
    "__version__",
    "clip_grad_norm_",
    "clip_on_step",
    "init",
    "monitored_barrier",
    "shutdown",
]
