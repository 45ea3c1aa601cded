"""Where a worker stands: the torchrun contract, MPI's or Slurm's, or explicit arguments.

Pure functions over a mapping of environment variables, so every rule is tested without
processes. Two directions:

* :func:`worker_env` is what ``disttrain launch`` gives each worker: exactly torchrun's
  variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
  the GROUP_/ROLE_ companions), so a script runs unchanged under either launcher.
* :func:`resolve_placement` is what ``disttrain.init()`` reads back, in this order: explicit
  arguments, then the torchrun contract, then MPI's (:mod:`~disttrain.launch.mpi`), then
  Slurm's (:mod:`~disttrain.launch.slurm`), else a single process. :func:`launcher_of` is the
  same decision alone, for ``disttrain run`` ("am I one rank of a launched job?").
  Every error names the variable (or argument) to set.

MPI comes before Slurm because ``mpirun`` inside an allocation leaves the batch script's
SLURM_* variables in its ranks' environment, while srun never sets OpenMPI's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from disttrain.launch import mpi, slurm, threads
from disttrain.launch.placement import (
    PartialPlacement,
    Placement,
    PlacementError,
    parse_int,
)

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 300.0  # init_process_group and every blocking wait of the communicator
DEFAULT_EXIT_TIMEOUT_S = 30.0  # how long a failing rank may take to exit (hooks.bound_exit)
BACKENDS = ("gloo", "nccl", "mpi")  # and "auto": follow the device
_TRUE = {"1", "true", "yes", "on"}

__all__ = ["PartialPlacement", "Placement", "PlacementError", "launcher_of", "parse_int",
           "resolve_placement"]


def launcher_of(env: Mapping[str, str]) -> str | None:
    """Whose contract this environment carries: "torchrun" (also ``disttrain launch``),
    "mpi", "slurm", or None for a process nobody launched. Only the presence of the
    variables decides; whether they are complete is :func:`resolve_placement`'s check."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return "torchrun"
    if mpi.detect(env):
        return "mpi"
    if slurm.detect(env):
        return "slurm"
    return None


def resolve_placement(env: Mapping[str, str], *, rank: int | None = None,
                      world_size: int | None = None, local_rank: int | None = None,
                      master_addr: str | None = None,
                      master_port: int | None = None) -> Placement:
    """Combine explicit arguments (which win) with what the environment says."""
    source = launcher_of(env)
    if source == "torchrun":
        part = _from_torchrun(env)
    elif source == "mpi":
        part = mpi.task_from_env(env)
    elif source == "slurm":
        part = slurm.task_from_env(env)
    elif rank is None and world_size is None:
        tasks = slurm.batch_tasks(env)
        if tasks is not None:
            log.warning("this is the batch script of a Slurm job of SLURM_NTASKS=%d tasks, not "
                        "one of its tasks (SLURM_STEP_ID is not set): running as a single "
                        "process; start the ranks with srun", tasks)
        part = PartialPlacement("single", 0, 1)
    else:
        part = PartialPlacement("explicit")
        if rank is None or world_size is None:
            missing = "world_size" if world_size is None else "rank"
            raise PlacementError(f"init() got only one of rank/world_size; pass {missing}= "
                                 "too (or set RANK and WORLD_SIZE, or launch with disttrain "
                                 "launch, torchrun, srun or mpirun)")
    for name, value in (("rank", rank), ("world_size", world_size), ("local_rank", local_rank),
                        ("master_addr", master_addr), ("master_port", master_port)):
        if value is not None:
            setattr(part, name, value)
    if master_port is not None:
        part.rendezvous_id = None  # an explicit port is used as given
    return _complete(part, env)


def _from_torchrun(env: Mapping[str, str]) -> PartialPlacement:
    for name in ("RANK", "WORLD_SIZE"):
        if name not in env:
            other = "WORLD_SIZE" if name == "RANK" else "RANK"
            raise PlacementError(f"{other} is set but {name} is not; set both (disttrain "
                                 "launch and torchrun do), or neither")
    part = PartialPlacement(
        "torchrun",
        parse_int("RANK", env["RANK"], "set it to this process's rank, 0..WORLD_SIZE-1"),
        parse_int("WORLD_SIZE", env["WORLD_SIZE"], "set it to the number of processes"))
    if env.get("LOCAL_RANK"):
        part.local_rank = parse_int("LOCAL_RANK", env["LOCAL_RANK"],
                                    "set it to this process's index on its node")
    if env.get("LOCAL_WORLD_SIZE"):
        part.local_world_size = parse_int("LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"],
                                          "set it to the number of processes on this node")
    return part


def _complete(part: PartialPlacement, env: Mapping[str, str]) -> Placement:
    """Fill local rank, master address and port; check ranges with the variables' names."""
    assert part.rank is not None and part.world_size is not None
    rank, world = part.rank, part.world_size
    if world < 1:
        raise PlacementError(f"WORLD_SIZE={world} must be ≥ 1 (the number of processes)")
    if not 0 <= rank < world:
        raise PlacementError(f"RANK={rank} is out of range for WORLD_SIZE={world}: RANK must "
                             f"be in 0..{world - 1}; set RANK and WORLD_SIZE consistently")
    local_world = part.local_world_size
    local_rank = part.local_rank
    if local_rank is None:
        local_rank = rank if local_world is None else rank % local_world
    locality_known = local_world is not None
    if local_world is None:
        local_world = max(world, local_rank + 1)
    if not 0 <= local_rank < local_world:
        raise PlacementError(f"LOCAL_RANK={local_rank} is out of range for LOCAL_WORLD_SIZE="
                             f"{local_world}; set them consistently")
    addr = (part.master_addr or env.get("MASTER_ADDR")
            or _default_master_addr(world, local_world if locality_known else None))
    port: int | None = part.master_port
    if port is None and env.get("MASTER_PORT"):
        port = parse_int("MASTER_PORT", env["MASTER_PORT"],
                         "set it to a free TCP port on the master node")
    if port is None and world > 1:
        raise PlacementError(f"MASTER_PORT is not set but {world} processes must meet; "
                             f"{part.port_hint} (a free TCP port on the node of rank 0), or "
                             "pass master_port=")
    return Placement(rank, world, local_rank, local_world, addr, port, part.source,
                     part.rendezvous_id if port == part.master_port else None,
                     single_host=locality_known and local_world >= world)


def _default_master_addr(world: int, local_world: int | None) -> str:
    if world == 1 or (local_world is not None and local_world >= world):
        return LOOPBACK  # every rank runs on this machine
    spans = ("spans several nodes" if local_world is not None else
             "may span several nodes (LOCAL_WORLD_SIZE is not set either)")
    raise PlacementError(
        f"MASTER_ADDR is not set, and WORLD_SIZE={world} {spans}; set MASTER_ADDR to the "
        "address of the node running rank 0, e.g. 127.0.0.1 when every rank runs on this "
        "machine (or pass master_addr=)")


def _seconds(env: Mapping[str, str], name: str) -> float | None:
    """$``name`` as a number of seconds; None when it is unset or empty."""
    text = env.get(name)
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise PlacementError(f"{name}={text!r} is not a number of seconds") from None


def resolve_timeout(timeout_s: float | None, env: Mapping[str, str]) -> float:
    """Explicit argument, else $DISTTRAIN_TIMEOUT, else :data:`DEFAULT_TIMEOUT_S`."""
    if timeout_s is None:
        timeout_s = _seconds(env, "DISTTRAIN_TIMEOUT")
        if timeout_s is None:
            return DEFAULT_TIMEOUT_S
    if not 0 < timeout_s < float("inf"):
        raise PlacementError(f"the timeout must be a positive number of seconds, got "
                             f"{timeout_s!r} (DISTTRAIN_TIMEOUT or timeout_s=)")
    return float(timeout_s)


def resolve_init_timeout(init_timeout_s: float | None, timeout_s: float,
                         env: Mapping[str, str]) -> float:
    """How long ranks wait for each other to *start* (the rendezvous): explicit argument,
    else $DISTTRAIN_INIT_TIMEOUT, else the larger of ``timeout_s`` and
    :data:`DEFAULT_TIMEOUT_S`. Starting N Python processes on a busy machine can take far
    longer than one collective should, so a short operation timeout does not shorten it."""
    if init_timeout_s is None:
        init_timeout_s = _seconds(env, "DISTTRAIN_INIT_TIMEOUT")
    if init_timeout_s is None:
        return max(timeout_s, DEFAULT_TIMEOUT_S)
    if not 0 < init_timeout_s < float("inf"):
        raise PlacementError(f"the start-up timeout must be a positive number of seconds, got "
                             f"{init_timeout_s!r} (DISTTRAIN_INIT_TIMEOUT or init_timeout_s=)")
    return float(init_timeout_s)


def resolve_exit_timeout(exit_timeout_s: float | None, env: Mapping[str, str]) -> float:
    """How long a rank that is exiting on an error may take before it is stopped with a
    dump of its threads' stacks (:func:`disttrain.launch.hooks.bound_exit`): explicit
    argument, else $DISTTRAIN_EXIT_TIMEOUT, else :data:`DEFAULT_EXIT_TIMEOUT_S`; 0 turns the
    bound off."""
    if exit_timeout_s is None:
        exit_timeout_s = _seconds(env, "DISTTRAIN_EXIT_TIMEOUT")
        if exit_timeout_s is None:
            return DEFAULT_EXIT_TIMEOUT_S
    if isinstance(exit_timeout_s, bool) or not 0 <= exit_timeout_s < float("inf"):
        raise PlacementError(f"the exit timeout must be a number of seconds ≥ 0 (0: no bound), "
                             f"got {exit_timeout_s!r} (DISTTRAIN_EXIT_TIMEOUT or "
                             f"exit_timeout_s=)")
    return float(exit_timeout_s)


def resolve_debug(debug: bool | None, env: Mapping[str, str]) -> bool:
    """Explicit argument, else DISTTRAIN_DEBUG=1 or TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    if debug is not None:
        return bool(debug)
    return (env.get("DISTTRAIN_DEBUG", "").strip().lower() in _TRUE
            or env.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL")


def choose_backend(requested: str | None, env: Mapping[str, str], cuda_available: bool,
                   device: str | None = None) -> str:
    """The backend follows the device: NCCL for ``cuda`` (``cuda:N``), Gloo for ``cpu``;
    with no device (or ``auto``), NCCL when CUDA is available, else Gloo. ``requested`` or
    $DISTTRAIN_BACKEND wins (Gloo serves a GPU job too: the Communicator stages CUDA
    tensors through pinned host memory)."""
    name = (requested or env.get("DISTTRAIN_BACKEND") or "").strip().lower()
    if device is not None and device.startswith("cuda") and not cuda_available:
        raise PlacementError(f"device {device!r} needs CUDA, which is not available here; use "
                             f"device 'cpu' (or 'auto')")
    if not name or name == "auto":
        if device is not None and device.startswith("cuda"):
            return "nccl"
        if device == "cpu":
            return "gloo"
        return "nccl" if cuda_available else "gloo"
    if name not in BACKENDS:
        raise PlacementError(f"backend {name!r} is unknown; choose auto or one of "
                             f"{', '.join(BACKENDS)} (argument backend= or DISTTRAIN_BACKEND)")
    if name == "nccl" and not cuda_available:
        raise PlacementError("backend 'nccl' needs CUDA, which is not available here; use "
                             "'gloo' (or leave the backend unset to choose automatically)")
    return name


def worker_env(base: Mapping[str, str], *, local_rank: int, nproc_per_node: int,
               nnodes: int, node_rank: int, master_addr: str, master_port: int,
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one worker: ``base`` plus torchrun's variables (and ``extra``)."""
    world = nnodes * nproc_per_node
    rank = node_rank * nproc_per_node + local_rank
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        # like torchrun: rank 0 does not host the rendezvous store, the launcher does
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    })
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the rank prefixer as they happen
    if nproc_per_node > 1:  # N workers share this host's cores (launch/threads.py)
        env.setdefault(threads.OMP_VAR, str(threads.threads_per_rank(nproc_per_node, base)))
    env.update(extra or {})
    return env
