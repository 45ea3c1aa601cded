"""Run test functions on real ranks over Gloo, with short timeouts and named failures.

Two ways:

* :class:`DistPool` keeps ``world_size`` processes alive with an initialized process group
  (a ``file://`` store in a temp dir: no ports to clash) and runs ``fn(comm, *args)`` on all
  of them, returning the per-rank results. Starting ranks costs seconds on 2 cores, so
  pools are shared across test cases (see ``conftest.py``). A failure on any rank is
  re-raised with its rank number and traceback, and the pool is restarted, so the next
  test starts clean; so is a pool whose rank died between two tests (with a warning),
  instead of every later test failing on a broken pipe.
* :func:`run_fresh` starts new processes for one call of ``fn(rank, world_size, store, *args)``,
  for tests that need their own initialization or that kill ranks.

Functions must be importable module-level functions (they are pickled to the ranks). Ranks
come from :func:`rank_context`: forked from a server that imported torch once, with this
process's environment of the moment applied first (a fork server's children would otherwise
see the environment it started with). The pipes carry pickles between this test process and
its own children only.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection as mpc
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from disttrain.launch import ranks as launch_ranks
from disttrain.launch.ranks import environment

DEFAULT_TIMEOUT_S = 120.0  # a whole call on every rank
COMM_TIMEOUT_S = 20.0  # each blocking wait inside a collective


def rank_context() -> Any:
    """The context test ranks start from: forked from a server that preloaded torch
    (:func:`disttrain.launch.ranks.rank_context`); hand each rank :func:`environment`."""
    return launch_ranks.rank_context()


def adopt_environment(env: dict[str, str]) -> None:
    """In a rank: the parent's environment of the moment, and one intra-op thread (torch was
    imported by the server, before any variable here could set it)."""
    launch_ranks.adopt_environment(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


class RankFailure(AssertionError):
    """A rank raised (or died, or timed out); the message names it."""


def _init_torch(rank: int, world_size: int, store: str, comm_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=comm_timeout_s),
    )


def _pool_worker(rank: int, world_size: int, store: str, conn: Any, comm_timeout_s: float,
                 env: dict[str, str], nccl_rules: bool | None = None) -> None:
    adopt_environment(env)
    try:
        _init_torch(rank, world_size, store, comm_timeout_s)
        from disttrain.comm import CommConfig, Communicator

        rules = {} if nccl_rules is None else {"nccl_rules": nccl_rules}  # None: the env's
        comm = Communicator.from_torch(config=CommConfig(timeout_s=comm_timeout_s, **rules))
        conn.send(("ready", None))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(comm, *args, **kwargs)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    import torch.distributed as dist

    dist.destroy_process_group()


class DistPool:
    """``world_size`` live ranks; ``run(fn, *args)`` → list of per-rank results."""

    def __init__(self, world_size: int, comm_timeout_s: float = COMM_TIMEOUT_S, *,
                 nccl_rules: bool | None = None) -> None:
        self.world_size = world_size
        self.comm_timeout_s = comm_timeout_s
        self.nccl_rules = nccl_rules  # the ranks' communicator: CommConfig(nccl_rules=...)
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def _start(self) -> None:
        ctx = rank_context()
        self._tmp = tempfile.TemporaryDirectory(prefix="disttrain-test-")
        store = os.path.join(self._tmp.name, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_pool_worker, daemon=True,
                               args=(rank, self.world_size, store, child, self.comm_timeout_s,
                                     environment(), self.nccl_rules))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("start-up", DEFAULT_TIMEOUT_S)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = mpc.wait([*waiting, *sentinels], timeout=min(left, 1.0))
            for item in ready:
                if item in waiting:
                    rank = waiting.pop(item)
                    try:
                        status, value = item.recv()
                    except EOFError:
                        errors[rank] = "process exited without answering"
                        continue
                    if status == "err":
                        errors[rank] = value
                    else:
                        results[rank] = value
                elif item in sentinels:
                    rank = sentinels.pop(item)
                    conn = self._conns[rank]
                    if conn in waiting and not conn.poll(0.2):
                        waiting.pop(conn)
                        errors[rank] = f"process died (exit code {self._procs[rank].exitcode})"
            if errors:  # others are likely stuck waiting for the failed rank
                break
        if errors or waiting:
            self.close()
            first = min(errors) if errors else None
            missing = sorted(waiting.values())
            message = f"{what} failed on {self.world_size} rank(s)."
            if first is not None:
                message += (f"\n--- rank {first} (first of ranks {sorted(errors)}) ---\n"
                            f"{errors[first]}")
            if missing and first is None:
                message += f"\nranks {missing} did not answer within {timeout_s:g}s"
            raise RankFailure(message)
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
            **kwargs: Any) -> list[Any]:
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
        if dead:  # killed between two tests (a failure inside a test restarts the pool):
            warnings.warn(f"DistPool({self.world_size}): rank(s) {[r for r, _ in dead]} died "
                          f"between tests (exit codes {[c for _, c in dead]}); starting a "
                          f"fresh pool", stacklevel=2)  # not every later test's failure
            self.close()
        if not self._procs:
            self._start()
        try:
            for conn in self._conns:
                conn.send((fn, args, kwargs))
        except OSError as exc:  # a rank died just now (BrokenPipeError is an OSError)
            self.close()
            raise RankFailure(f"{getattr(fn, '__name__', fn)} could not be sent to every rank "
                              f"of the pool: a rank process went away ({exc})") from exc
        return self._collect(f"{getattr(fn, '__name__', fn)}", timeout_s)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 1.0  # a short grace period, then no ceremony:
        for proc in self._procs:  # pool workers hold nothing that needs a clean exit
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self._procs, self._conns = [], []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _fresh_worker(rank: int, world_size: int, store: str, conn: Any,
                  fn: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str]) -> None:
    adopt_environment(env)
    try:
        conn.send(("ok", fn(rank, world_size, store, *args)))
    except BaseException:
        conn.send(("err", traceback.format_exc()))


def run_fresh(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world_size, store_path, *args)`` in ``world_size`` new processes; the
    function initializes whatever it needs (``init_gloo`` below is the usual start)."""
    pool = DistPool(world_size)
    ctx = rank_context()
    pool._tmp = tempfile.TemporaryDirectory(prefix="disttrain-test-")
    store = os.path.join(pool._tmp.name, "store")
    for rank in range(world_size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_fresh_worker, daemon=True,
                           args=(rank, world_size, store, child, fn, args, environment()))
        proc.start()
        child.close()
        pool._procs.append(proc)
        pool._conns.append(parent)
    try:
        return pool._collect(getattr(fn, "__name__", "fn"), timeout_s)
    finally:
        pool.close()


def wait_until_posts_refused(peer: int, limit_s: float = 30.0) -> bool:
    """After ``peer`` died: poll until Gloo refuses to even post a receive from it (on the
    default group, on a tag nothing else uses), so a test can exercise that refusal rather
    than a failed wait. False if Gloo still accepted posts after ``limit_s``."""
    import torch
    import torch.distributed as dist

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            dist.group.WORLD.recv([torch.zeros(1)], peer, 999)
        except RuntimeError:
            return True
        time.sleep(0.05)
    return False


def init_gloo(rank: int, world_size: int, store: str,
              comm_timeout_s: float = COMM_TIMEOUT_S, **config: Any) -> Any:
    """Initialize Gloo for a :func:`run_fresh` worker and return a Communicator."""
    _init_torch(rank, world_size, store, comm_timeout_s)
    from disttrain.comm import CommConfig, Communicator

    return Communicator.from_torch(config=CommConfig(timeout_s=comm_timeout_s, **config))
