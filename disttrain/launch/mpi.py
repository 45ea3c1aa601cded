"""MPI launchers' view of a process (``mpirun``/``mpiexec``): OpenMPI, MPICH and Intel MPI.

MPI does the launching only; Gloo (or NCCL) does the communication, since torch's wheels
have no MPI backend. Each launcher says where a process stands in its own words:

    OpenMPI            OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
    MPICH, Intel MPI   PMI_RANK / PMI_SIZE, MPI_LOCALRANKID / MPI_LOCALNRANKS (Hydra)

None says where rank 0 runs. When every rank runs on this machine (local size = size) the
master is 127.0.0.1; otherwise pass its address (``mpirun -x MASTER_ADDR=node01``, MPICH
``-genv MASTER_ADDR node01``). The port is MASTER_PORT, else derived from the job id every
rank of an OpenMPI job shares (``OMPI_MCA_ess_base_jobid``, 4.x; ``PMIX_NAMESPACE``, 5.x).
"""

from __future__ import annotations

from collections.abc import Mapping

from disttrain.launch.placement import (
    PartialPlacement,
    PlacementError,
    derived_port,
    parse_int,
    require,
)

OPENMPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
           "OMPI_COMM_WORLD_LOCAL_SIZE")
HYDRA = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
_JOB_IDS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")  # shared by every rank of a job


def detect(env: Mapping[str, str]) -> bool:
    """Whether an MPI launcher started this process."""
    return any(env.get(name) for name in (*OPENMPI[:2], *HYDRA[:2]))


def task_from_env(env: Mapping[str, str]) -> PartialPlacement:
    """This process's place, from OpenMPI's or Hydra's variables (MASTER_* override)."""
    names = OPENMPI if any(env.get(n) for n in OPENMPI[:2]) else HYDRA
    rank_var, size_var, local_var, local_size_var = names
    given = rank_var if env.get(rank_var) else size_var
    require(env, (rank_var, size_var), f"{given} says an MPI launcher started this process "
                                       "(it sets both)")
    part = PartialPlacement(
        "mpi", parse_int(rank_var, env[rank_var], "mpirun sets it to this process's rank"),
        parse_int(size_var, env[size_var], "mpirun sets it to the number of processes"),
        addr_hint="pass it with mpirun -x MASTER_ADDR=<host of rank 0> (MPICH: -genv)",
        port_hint="pass it with mpirun -x MASTER_PORT=<free port> (MPICH: -genv)")
    if env.get(local_var):
        part.local_rank = parse_int(local_var, env[local_var], "mpirun sets it")
    if env.get(local_size_var):
        part.local_world_size = parse_int(local_size_var, env[local_size_var], "mpirun sets it")
    part.master_addr = env.get("MASTER_ADDR") or None
    if part.master_addr is None and part.world_size and part.world_size > 1 and (
            part.local_world_size is None or part.local_world_size < part.world_size):
        spread = (f"{local_size_var}={part.local_world_size} of {part.world_size} ranks run "
                  "on this machine" if part.local_world_size is not None else
                  f"{local_size_var} is not set, so the ranks may span several machines")
        raise PlacementError(f"MASTER_ADDR is not set and {spread}; mpirun does not say where "
                             f"rank 0 runs: {part.addr_hint}")
    if env.get("MASTER_PORT"):
        part.master_port = parse_int("MASTER_PORT", env["MASTER_PORT"],
                                     "set it to a free TCP port on the node of rank 0")
    else:
        job = next((env[n].strip() for n in _JOB_IDS if env.get(n)), None)
        if job is not None:
            part.rendezvous_id = f"mpi-{job}"
            part.master_port = derived_port(part.rendezvous_id)
    return part
