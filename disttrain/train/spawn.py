"""Run the training loop on ranks: local processes started here, or the ranks of a launched job.

``run_local`` spawns ``world_size`` processes on this machine. They meet through a file store
in a fresh temporary directory (no port to clash with other jobs) with the same rendezvous
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

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import secrets
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

from disttrain.comm import CommConfig, Communicator
from disttrain.comm.transports.shm.segment import SHM_TAG_VAR, unlink_tagged
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


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


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


def _worker(rank: int, world_size: int, store_path: str, config: TrainConfig,
            comm_config: CommConfig, transport: str, log_level: int, conn: Any,
            parent: int, shm_tag: str, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    from disttrain.launch import deathsig, rendezvous
    from disttrain.launch.env import resolve_init_timeout

    deathsig.set_parent_death_signal(signal.SIGKILL, parent)  # no rank outlives disttrain run
    os.environ[SHM_TAG_VAR] = shm_tag  # the parent removes what a killed rank leaves
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(_threads_per_rank(world_size))
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
        conn.send(("ok", result.without_model()))
    except (ValueError, ImportError) as exc:  # bad input or a missing package (exit 2 in the CLI)
        conn.send(("invalid", str(exc)))
    except BaseException as exc:
        conn.send(("error", traceback.format_exc(), rank_failures.facts_of(exc, comm)))
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
    ctx = mp.get_context("spawn")
    shm_tag = f"r{os.getpid():x}{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory(prefix="disttrain-run-") as tmp:
        store = os.path.join(tmp, "store")
        procs, conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, name=f"disttrain-rank{rank}", daemon=True,
                               args=(rank, world_size, store, config, comm_config, transport,
                                     logging.getLogger().getEffectiveLevel(), child,
                                     os.getpid(), shm_tag, backend))
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        finished = False
        losable = get_strategy(config.strategy).losable_ranks(config, world_size)
        try:
            results = _collect(procs, conns, timeout_s, losable)
            finished = True
            log.debug("results from all %d ranks received", world_size)
            return results
        finally:
            _stop(procs, grace_s=30.0 if finished else 0.0)
            left = unlink_tagged(shm_tag)  # a rank killed during shared-memory set-up
            if left:
                log.warning("removed shared-memory segment(s) a dead rank left: %s", left)
            log.debug("all %d ranks stopped (exit codes %s)", world_size,
                      [proc.exitcode for proc in procs])


_GRACE_S = 1.0  # after a first failure, how long the others may take to report theirs


def _collect(procs: list[Any], conns: list[Any], timeout_s: float | None,
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
    waiting = {conn: rank for rank, conn in enumerate(conns)}
    sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while waiting:
        now = time.monotonic()
        if grace_end is not None and now >= grace_end:
            break
        if grace_end is None and deadline is not None and now > deadline:
            raise RankFailedError(min(waiting.values()), "timed out",
                                  f"no result within {timeout_s:g}s (ranks still running: "
                                  f"{sorted(waiting.values())})")
        wait_s = 1.0 if grace_end is None else min(1.0, grace_end - now)
        for item in mpc.wait([*waiting, *sentinels], timeout=max(0.0, wait_s)):
            if item in waiting:
                rank = waiting.pop(item)
                try:
                    _receive(item, rank, results, procs[rank])
                except RankFailedError as exc:
                    (lost if rank in losable and not failed else failed).append(exc)
            elif item in sentinels:
                rank = sentinels.pop(item)
                conn = conns[rank]
                if conn in waiting and not conn.poll(0.5):
                    waiting.pop(conn)
                    death = rank_failures.died(rank, procs[rank].exitcode)
                    (lost if rank in losable and not failed else failed).append(death)
        if failed and grace_end is None:
            grace_end = time.monotonic() + _GRACE_S
    if failed:
        raise root_cause(lost + failed, {rank: proc.pid for rank, proc in enumerate(procs)})
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


def _receive(conn: Any, rank: int, results: dict[int, TrainResult], proc: Any) -> None:
    try:
        message = conn.recv()
    except EOFError:
        proc.join(0.5)  # its exit status says how it ended
        raise rank_failures.died(rank, proc.exitcode) from None
    status, value = message[0], message[1]
    if status == "invalid":
        raise ValueError(f"{value} (reported by rank {rank})")
    if status == "error":
        log.error("rank %d failed:\n%s", rank, value)
        raise rank_failures.from_report(rank, value, message[2] if len(message) > 2 else None)
    results[rank] = value


def _stop(procs: list[Any], grace_s: float) -> None:
    """Let finished ranks exit (they destroy their process group); stop the rest. After a
    failure the survivors are usually blocked on the failed rank, so they go at once. A
    stopped rank (SIGSTOP) gets SIGCONT after SIGTERM, or SIGTERM could not act on it."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


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
