"""Run the training loop on ranks: local processes started here, or the ranks of a launched job.

``run_local`` spawns ``world_size`` processes on this machine. They meet through a ``file://``
store in a fresh temporary directory (no port to clash with other jobs), use the given
backend (Gloo, or NCCL with a GPU per rank: rank r trains on ``cuda:r``), and send their
:class:`TrainResult` back through a pipe to this process (their parent). A rank that raises
or dies is named, the others are stopped, and :class:`RankFailedError` says which; but a
rank the strategy outlives (a ps-async or ps-ssp worker: ``StrategySpec.losable_ranks``) is
only reported (a warning) when the others finish without it and say so
(``extras["lost_workers"]``), and the survivors' results are returned.

``run_in_job`` is for processes started by ``torchrun``, ``disttrain launch`` or Slurm, where
``RANK``/``WORLD_SIZE`` are already in the environment.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import sys
import tempfile
import time
import traceback
from typing import Any

from disttrain.comm import CommConfig, Communicator
from disttrain.train.config import TrainConfig
from disttrain.train.device import select_local_gpu
from disttrain.train.loop import train
from disttrain.train.result import TrainResult
from disttrain.train.strategies import get_strategy

log = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A rank raised, died or timed out; ``rank`` and ``kind`` say which and how."""

    def __init__(self, rank: int, kind: str, detail: str) -> None:
        super().__init__(f"rank {rank} {kind}: {detail}")
        self.rank, self.kind, self.detail = rank, kind, detail


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


def _worker(rank: int, world_size: int, store: str, config: TrainConfig,
            comm_config: CommConfig, transport: str, log_level: int, conn: Any,
            backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(_threads_per_rank(world_size))
    try:
        select_local_gpu(config.device, rank)  # cuda:rank: every rank here is local
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=comm_config.timeout_s))
        comm = make_comm(transport, comm_config)
        try:
            result = train(config, comm)
        finally:
            comm.close()
        conn.send(("ok", result.without_model()))
    except (ValueError, ImportError) as exc:  # bad input or a missing package (exit 2 in the CLI)
        conn.send(("invalid", str(exc)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
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
    with tempfile.TemporaryDirectory(prefix="disttrain-run-") as tmp:
        store = os.path.join(tmp, "store")
        procs, conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, name=f"disttrain-rank{rank}", daemon=True,
                               args=(rank, world_size, store, config, comm_config, transport,
                                     logging.getLogger().getEffectiveLevel(), child, backend))
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
            log.debug("all %d ranks stopped (exit codes %s)", world_size,
                      [proc.exitcode for proc in procs])


# A rank whose error ends in one of these failed because another rank did: a dead or
# failed peer (disttrain.comm's errors, Gloo's broken connections) or a wait that ran out.
_CONSEQUENCES = ("PeerFailedError", "CommTimeoutError", "PSTimeoutError",
                 "Connection closed by peer",
                 "Connection reset by peer", "Broken pipe")
_GRACE_S = 1.0  # after a first failure, how long the others may take to report theirs


def _collect(procs: list[Any], conns: list[Any], timeout_s: float | None,
             losable: frozenset[int] = frozenset()) -> list[TrainResult]:
    """Every rank's result, or the root cause of a failure: after the first error or death,
    the other ranks get ``_GRACE_S`` to report theirs, and the first failure that is not a
    consequence of another's is raised (see :func:`root_cause`). The failure of a rank in
    ``losable`` is set aside while the others go on (:func:`_survivors`)."""
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
                    _receive(item, rank, results)
                except RankFailedError as exc:
                    (lost if rank in losable and not failed else failed).append(exc)
            elif item in sentinels:
                rank = sentinels.pop(item)
                conn = conns[rank]
                if conn in waiting and not conn.poll(0.5):
                    waiting.pop(conn)
                    death = RankFailedError(rank, "died",
                                            f"process exited with code {procs[rank].exitcode}")
                    (lost if rank in losable and not failed else failed).append(death)
        if failed and grace_end is None:
            grace_end = time.monotonic() + _GRACE_S
    if failed:
        raise root_cause(lost + failed)
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


def root_cause(failed: list[RankFailedError]) -> RankFailedError:
    """The first failure (in the order seen) that is not a consequence of another rank's
    (a broken connection, a dead peer, a timeout); the first one if all are. A survivor
    blocked on the failed rank may report before it, and must not be named instead."""
    return min(failed, key=lambda e: any(m in e.detail for m in _CONSEQUENCES))


def _receive(conn: Any, rank: int, results: dict[int, TrainResult]) -> None:
    try:
        status, value = conn.recv()
    except EOFError:
        raise RankFailedError(rank, "died", "process exited without a result") from None
    if status == "invalid":
        raise ValueError(f"{value} (reported by rank {rank})")
    if status == "error":
        log.error("rank %d failed:\n%s", rank, value)
        last = value.strip().splitlines()[-1] if value.strip() else "unknown error"
        raise RankFailedError(rank, "failed", last)
    results[rank] = value


def _stop(procs: list[Any], grace_s: float) -> None:
    """Let finished ranks exit (they destroy their process group); stop the rest. After a
    failure the survivors are usually blocked on the failed rank, so they go at once."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def in_launched_job() -> bool:
    """True when a launcher (torchrun, disttrain launch, srun wrapper) set RANK/WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_in_job(config: TrainConfig, comm_config: CommConfig | None = None,
               backend: str | None = None) -> TrainResult:
    """Train as one rank of an already launched job (environment variables set); the
    backend follows ``config.device`` unless ``backend`` (or $DISTTRAIN_BACKEND) says."""
    import torch.distributed as dist

    comm_config = comm_config or CommConfig()
    comm = _init_from_environment(comm_config, config.device, backend)
    try:
        return train(config, comm)
    finally:
        comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _init_from_environment(comm_config: CommConfig, device: str = "auto",
                           backend: str | None = None) -> Communicator:
    import torch.distributed as dist

    try:
        from disttrain.launch import init  # reads torchrun's and Slurm's contracts
    except ImportError:  # an installation without disttrain.launch: plain env:// below
        pass
    else:
        return init(None if backend == "auto" else backend, device=device,
                    timeout_s=comm_config.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://",
                                timeout=datetime.timedelta(seconds=comm_config.timeout_s))
    return Communicator.from_torch(config=comm_config)
