"""disttrain.launch: start ranks (``disttrain launch``) and join a job (``disttrain.init()``).

``launcher`` spawns and watches workers with torchrun's environment contract; ``env`` and
``slurm`` read that contract (or Slurm's) back; ``join`` (``init()``) joins the job and installs the
failure ``hooks`` (error records, flight-recorder dumps, a named root cause).
"""

from disttrain.launch.config import LaunchConfig, LaunchError
from disttrain.launch.env import Placement, PlacementError, resolve_placement
from disttrain.launch.hooks import WorkerTerminated
from disttrain.launch.join import InitError, init, shutdown

__all__ = [
    "InitError",
    "LaunchConfig",
    "LaunchError",
    "Placement",
    "PlacementError",
    "WorkerTerminated",
    "init",
    "resolve_placement",
    "shutdown",
]
