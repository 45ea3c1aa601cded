"""disttrain.launch: start ranks (``disttrain launch``) and join a job (``disttrain.init()``).

``launcher`` spawns and watches workers with torchrun's environment contract; ``env``,
``mpi`` and ``slurm`` read that contract (or mpirun's, or srun's) back into a ``placement``;
``join`` (``init()``) meets the other ranks through ``rendezvous`` and installs the failure
``hooks`` (error records, flight-recorder dumps, a named root cause).
"""

from disttrain.launch.config import LaunchConfig, LaunchError
from disttrain.launch.env import launcher_of, resolve_placement
from disttrain.launch.hooks import WorkerTerminated
from disttrain.launch.join import InitError, init, shutdown
from disttrain.launch.placement import Placement, PlacementError

__all__ = [
    "InitError",
    "LaunchConfig",
    "LaunchError",
    "Placement",
    "PlacementError",
    "WorkerTerminated",
    "init",
    "launcher_of",
    "resolve_placement",
    "shutdown",
]
