"""Run the training loop on ranks: local processes started here, or the ranks of a launched job.

``run_local`` spawns ``world_size`` processes on this machine
(:class:`~disttrain.launch.ranks.LocalRanks`). They meet through a file store in a fresh
temporary directory (no port to clash with other jobs) with the same rendezvous
as ``disttrain.init()`` (a rank that never comes is named), use the given backend (Gloo, or
NCCL with a GPU per rank: rank r trains on ``cuda:r``), and send their
:class:`TrainResult` back through a pipe to this process (their parent). A rank that raises,
dies or falls silent is named (:mod:`disttrain.train.rank_failures`), the others are
stopped, and :class:`RankFailedError` says which; but a rank the strategy outlives (a
ps-async or ps-ssp worker: ``StrategySpec.losable_ranks``) is only reported (a warning) when
the others finish without it and say so (``extras["lost_workers"]``), and the survivors'
results are returned. Every rank gets SIGKILL from the kernel if this process dies
(``PR_SET_PDEATHSIG``), so a killed ``disttrain run`` leaves no rank.

``run_in_job`` is for processes started by ``torchrun``, ``disttrain launch``, ``srun`` or
``mpirun`` (:func:`in_launched_job` asks :func:`disttrain.launch.launcher_of`).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
import traceback

from disttrain.comm import CommConfig, Communicator
from disttrain.comm.transports.shm.segment import SHM_TAG_VAR, unlink_tagged
from disttrain.launch.ranks import LocalRanks, RankChannel, RankEvent
from disttrain.train import rank_failures
from disttrain.train.config import TrainConfig
from disttrain.train.device import select_local_gpu
from disttrain.train.loop import train
from disttrain.train.rank_failures import RankFailedError, root_cause
from disttrain.train.result import TrainResult
from disttrain.train.strategies import get_strategy

__all__ = ["RankFailedError", "in_launched_job", "make_comm", "root_cause", "run_in_job",
           "run_local"]

log = logging.getLogger(__name__)


def make_comm(transport: str, comm_config: CommConfig) -> Communicator:
    """A Communicator over the initialized default group, moving bytes by ``transport``
    ("torch": torch.distributed point-to-point; "shm": shared memory; "auto")."""
    if transport == "torch":
        return Communicator.from_torch(config=comm_config)
    try:
        from disttrain.comm.transports import make_transport
    except ImportError as exc:
        raise ValueError(f"transport {transport!r} is not available here ({exc}); use "
                         f"'torch'") from exc
    return Communicator(make_transport(transport, timeout_s=comm_config.timeout_s), comm_config)


def _worker(rank: int, world_size: int, store_path: str, channel: RankChannel,
            config: TrainConfig, comm_config: CommConfig, transport: str, log_level: int,
            shm_tag: str, backend: str = "gloo") -> None:
    """One rank of ``run_local``: its verdict is one report, ``("ok", result)``,
    ``("invalid", message)`` or ``("error", traceback, facts)``, sent before the clean-up."""
    import torch
    import torch.distributed as dist

    from disttrain.launch import rendezvous
    from disttrain.launch.env import LOOPBACK, resolve_init_timeout
    from disttrain.launch.netif import gloo_interface_for
    from disttrain.launch.threads import threads_per_rank

    os.environ[SHM_TAG_VAR] = shm_tag  # the parent removes what a killed rank leaves
    if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
        interface = gloo_interface_for(LOOPBACK, single_host=True)  # every rank is here
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface  # not the LAN address
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads_per_rank(world_size))  # as every launcher's ranks
    comm = None
    try:
        select_local_gpu(config.device, rank)  # cuda:rank: every rank here is local
        store = dist.FileStore(store_path, world_size)
        start_s = resolve_init_timeout(None, comm_config.timeout_s, os.environ)
        rendezvous.join(store, rank, world_size, start_s)
        rendezvous.init_group(backend, store, rank, world_size, start_s, comm_config.timeout_s)
        comm = make_comm(transport, comm_config)
        try:
            result = train(config, comm)
        finally:
            comm.close()
        channel(("ok", result.without_model()))
    except (ValueError, ImportError) as exc:  # bad input or a missing package (exit 2 in the CLI)
        channel(("invalid", str(exc)))
    except BaseException as exc:
        channel(("error", traceback.format_exc(), rank_failures.facts_of(exc, comm)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(config: TrainConfig, world_size: int, comm_config: CommConfig | None = None,
              timeout_s: float | None = None, transport: str = "torch",
              backend: str = "gloo") -> list[TrainResult]:
    """Train on ``world_size`` new local processes; returns every rank's result (rank order;
    the surviving ranks' of a run that outlived a rank, the first of them the one reporting).

    ``timeout_s`` bounds the whole run (None: no limit; every collective is still bounded by
    ``comm_config.timeout_s``); ``transport`` is how disttrain.comm moves bytes, over the
    torch.distributed ``backend`` (:func:`~disttrain.train.device.local_backend`)."""
    comm_config = comm_config or CommConfig()
    losable = get_strategy(config.strategy).losable_ranks(config, world_size)
    shm_tag = f"r{os.getpid():x}{secrets.token_hex(3)}"
    level = logging.getLogger().getEffectiveLevel()
    ranks = LocalRanks(_worker, [(config, comm_config, transport, level, shm_tag, backend)]
                       * world_size, start="spawn", prefix="disttrain-run-")
    finished = False
    try:
        results = _collect(ranks, timeout_s, losable)
        finished = True
        log.debug("results from all %d ranks received", world_size)
        return results
    finally:
        # finished ranks destroy their process group; after a failure the survivors are
        # usually blocked on the failed rank, so they go at once
        ranks.close(grace_s=30.0 if finished else 0.0)
        left = unlink_tagged(shm_tag)  # a rank killed during shared-memory set-up
        if left:
            log.warning("removed shared-memory segment(s) a dead rank left: %s", left)
        log.debug("all %d ranks stopped (exit codes %s)", world_size,
                  [ranks.exit_code(rank) for rank in range(world_size)])


_GRACE_S = 1.0  # after a first failure, how long the others may take to report theirs


def _collect(ranks: LocalRanks, timeout_s: float | None,
             losable: frozenset[int] = frozenset()) -> list[TrainResult]:
    """Every rank's result, or the root cause of a failure: after the first error or death,
    the other ranks get ``_GRACE_S`` to report theirs, and the first failure that is not a
    consequence of another's is raised (see :func:`rank_failures.root_cause`). The failure
    of a rank in ``losable`` is set aside while the others go on (:func:`_survivors`)."""
    results: dict[int, TrainResult] = {}
    failed: list[RankFailedError] = []  # in the order they were seen
    lost: list[RankFailedError] = []  # losable ranks' failures, before any other
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    grace_end: float | None = None  # set by the first failure
    waiting = set(range(ranks.world_size))  # the ranks without a verdict
    while waiting:
        now = time.monotonic()
        if grace_end is not None and now >= grace_end:
            break
        if grace_end is None and deadline is not None and now > deadline:
            raise RankFailedError(min(waiting), "timed out",
                                  f"no result within {timeout_s:g}s (ranks still running: "
                                  f"{sorted(waiting)})")
        wait_s = 1.0 if grace_end is None else min(1.0, grace_end - now)
        for event in ranks.wait(wait_s):
            if event.rank in waiting:
                waiting.discard(event.rank)
                try:
                    _receive(event, results)
                except RankFailedError as exc:
                    (lost if event.rank in losable and not failed else failed).append(exc)
        if failed and grace_end is None:
            grace_end = time.monotonic() + _GRACE_S
    if failed:
        raise root_cause(lost + failed, ranks.pids)
    return _survivors(results, lost)


def _survivors(results: dict[int, TrainResult], lost: list[RankFailedError]
               ) -> list[TrainResult]:
    """The results, in rank order, of a run that outlived the ranks of ``lost`` (warned
    about); every survivor must say it went on without them, or the first is raised."""
    for exc in lost:
        if not all(exc.rank in r.extras.get("lost_workers", ()) for r in results.values()):
            raise exc  # the others did not go on without it: it failed their run
        log.warning("rank %d %s (%s); the other ranks went on without it", exc.rank, exc.kind,
                    exc.detail)
    return [results[rank] for rank in sorted(results)]


def _receive(event: RankEvent, results: dict[int, TrainResult]) -> None:
    """A rank's verdict: its result kept, or its failure raised."""
    rank = event.rank
    if event.kind == "died":
        raise rank_failures.died(rank, event.value)
    if event.kind == "done":  # ended without a verdict
        raise rank_failures.died(rank, 0)
    if event.kind == "error":  # raised outside _worker's own handling
        log.error("rank %d failed:\n%s", rank, event.value)
        raise rank_failures.from_report(rank, event.value, None)
    status, value = event.value[0], event.value[1]
    if status == "invalid":
        raise ValueError(f"{value} (reported by rank {rank})")
    if status == "error":
        log.error("rank %d failed:\n%s", rank, value)
        raise rank_failures.from_report(rank, value,
                                        event.value[2] if len(event.value) > 2 else None)
    results[rank] = value


def in_launched_job() -> str | None:
    """The launcher whose contract this process's environment carries ("torchrun" for
    torchrun and disttrain launch, "slurm", "mpi"), or None: the same decision as
    ``disttrain.init()``'s, so a process is never one rank of a job for one and a world of
    its own for the other."""
    from disttrain.launch.env import launcher_of

    return launcher_of(os.environ)


def run_in_job(config: TrainConfig, comm_config: CommConfig | None = None,
               backend: str | None = None, transport: str = "torch") -> TrainResult:
    """Train as one rank of an already launched job (its launcher's variables set), moving
    bytes by ``transport`` as ``run_local`` does; the backend follows ``config.device``
    unless ``backend`` (or $DISTTRAIN_BACKEND) says."""
    from disttrain.launch import hooks, init, shutdown

    comm_config = comm_config or CommConfig()
    comm = init(None if backend in (None, "auto") else backend, device=config.device,
                timeout_s=comm_config.timeout_s)  # reads every launcher's contract
    if transport != "torch":
        comm = make_comm(transport, comm_config)
        hooks.register(comm)  # its flight recorder is the one to dump on a failure
    try:
        return train(config, comm)
    finally:
        comm.close()
        shutdown()
