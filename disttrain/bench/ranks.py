"""Benchmark ranks: a job on every rank, its reports streamed back in rounds, cores bound.

``RankGroup(world_size, job, args)`` starts ``world_size`` local ranks
(:class:`~disttrain.launch.ranks.LocalRanks`: forked from a server that imported torch once,
meeting through a ``file://`` store in a fresh temp dir) that initialize Gloo (or NCCL) and
run ``job(comm, emit, *args)`` with a :class:`~disttrain.comm.Communicator`. Each call of
``emit(payload)`` on a rank is one report; :meth:`RankGroup.reports` yields, in order, the
list of every rank's k-th payload (rank order). A :class:`Heartbeat` payload is no report: it
goes to ``on_heartbeat`` as it comes, so ranks may send as many as they have (a parameter
server's rank, which takes no steps, sends none).

Nothing hangs: ranks' own waits time out (``timeout_s``), a rank that dies or raises is
reported by number with its traceback and what it was running, the parent gives up after
``4·timeout_s`` without any report, and ranks exit when the parent goes away. Leaving the
``with`` block (normally, on an error or on Ctrl-C) stops every rank and removes the temp
dir.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from disttrain.bench.transports import make_communicator
from disttrain.comm import Communicator
from disttrain.launch.ranks import LocalRanks, RankChannel

Job = Callable[..., None]
_BACKSTOP = 4.0  # the parent waits this many rank timeouts for a report before giving up


class BenchError(RuntimeError):
    """A benchmark rank failed, died or stopped reporting; the message names it."""


@dataclass(frozen=True)
class Heartbeat:
    """How far a rank got (``done``: steps, say), sent with ``emit`` between its reports:
    it resets the parent's silence backstop and is handed to the group's ``on_heartbeat``."""

    done: int


def bind_plan(world_size: int) -> list[int] | None:
    """The core each rank is bound to with ``bind_cores``: rank r on the r-th core this
    process may use, when there are enough cores; when the ranks are a whole multiple of
    several cores (4 ranks on 2), rank r on core r mod cores, every core carrying as many
    ranks (left to the kernel, DDP on 4 Gloo ranks of 2 cores ran 5.5-7.7 ms a step, bound
    so 5.0-5.3: docs/benchmarks.md, "Binding cores"); None otherwise (the ranks
    share the cores as the kernel likes) or where binding is unsupported."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if world_size <= len(cores):
        return cores[:world_size]
    if len(cores) > 1 and world_size % len(cores) == 0:
        return [cores[r % len(cores)] for r in range(world_size)]
    return None


def thread_cores(world_size: int, threads: int) -> list[tuple[int, ...]] | None:
    """The cores of each rank when every rank runs ``threads`` intra-op threads and is
    bound: consecutive blocks of ``threads`` cores (``threads`` = 1: :func:`bind_plan`),
    or None when there are not enough cores (the kernel places them)."""
    if threads == 1:
        plan = bind_plan(world_size)
        return None if plan is None else [(core,) for core in plan]
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if world_size * threads > len(cores):
        return None
    return [tuple(cores[r * threads:(r + 1) * threads]) for r in range(world_size)]


@contextlib.contextmanager
def rank_comm(rank: int, world_size: int, store: str, transport: str, timeout_s: float, *,
              threads: int = 1, backend: str = "gloo", device: str = "cpu"
              ) -> Iterator[Communicator]:
    """A benchmark or probe rank's communicator on ``transport`` over a process group met
    through the ``file://`` ``store``, every wait bounded by ``timeout_s``; closed with its
    process group on the way out. ``threads``: intra-op threads (1: ranks share the
    machine's cores); ``device`` other than CPU: rank r on ``cuda:r``, before NCCL starts."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if device != "cpu":  # every rank here is local
        from disttrain.train.device import select_local_gpu

        select_local_gpu(device, rank)
    comm = None
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        comm = make_communicator(transport, timeout_s)
        yield comm
    finally:
        if comm is not None:
            comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _bench_rank(rank: int, world_size: int, store: str, emit: RankChannel,
                cores: tuple[int, ...] | None, transport: str, timeout_s: float, job: Job,
                args: tuple[Any, ...], threads: int, backend: str, device: str) -> None:
    if cores is not None:  # first, so every thread the rank starts (Gloo's too) inherits it
        os.sched_setaffinity(0, set(cores))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # torch 2.13 deprecates the *_into_tensor names that native collectives call: not news to
    # someone reading a benchmark table, so keep it out of the ranks' output
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*torch\.distributed\.\w+` is deprecated")
    with rank_comm(rank, world_size, store, transport, timeout_s, threads=threads,
                   backend=backend, device=device) as comm:
        try:
            job(comm, emit, *args)
        except BaseException:
            emit.fail()  # before the clean-up, which may wait on a peer that is gone
            raise


class RankGroup:
    """``world_size`` local ranks running one job; use as a context manager."""

    def __init__(self, world_size: int, job: Job, args: tuple[Any, ...], *, transport: str,
                 timeout_s: float, describe: Callable[[int], str] = str,
                 bind_cores: bool = False, threads: int = 1, backend: str = "gloo",
                 device: str = "cpu",
                 on_heartbeat: Callable[[int, int], None] | None = None) -> None:
        """``bind_cores``: pin rank r to one core of its own (:func:`bind_plan`), as
        DeepSpeed's ``--bind_cores_to_rank`` does; otherwise the kernel may keep two ranks
        on one core for a whole run while the other idles, which makes runs bimodal.
        ``threads``: intra-op threads of every rank (bound: that many cores each).
        ``backend`` and ``device`` (``disttrain.train.device``): rank r on ``cuda:r``.
        ``on_heartbeat(rank, done)`` hears each :class:`Heartbeat` a rank sends."""
        if threads < 1:
            raise ValueError(f"threads must be ≥ 1, got {threads}")
        self.world_size, self.timeout_s, self._describe = world_size, timeout_s, describe
        self._finished, self._on_heartbeat = False, on_heartbeat
        self._received = [0] * world_size  # reports received from each rank so far
        cores = thread_cores(world_size, threads) if bind_cores else None
        self.ranks = LocalRanks(
            _bench_rank, [(None if cores is None else cores[rank], transport, timeout_s, job,
                           args, threads, backend, device) for rank in range(world_size)],
            name="disttrain-bench-r", prefix="disttrain-bench-")

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reports(self) -> Iterator[list[Any]]:
        """Every rank's k-th report, for k = 0, 1, …, until all ranks are done."""
        queues: list[list[Any]] = [[] for _ in range(self.world_size)]
        while self.ranks.pending:
            while all(queues[r] for r in range(self.world_size)):
                yield [queues[r].pop(0) for r in range(self.world_size)]
            self._receive(queues)
        while all(queues[r] for r in range(self.world_size)):
            yield [queues[r].pop(0) for r in range(self.world_size)]
        self._finished = True
        if any(queues):
            raise BenchError("ranks finished with different numbers of reports: "
                             f"{[len(q) for q in queues]} left over")

    def _receive(self, queues: list[list[Any]]) -> None:
        """Wait for the next messages from the ranks; raise on error, death or silence,
        naming the rank and what it was doing (its next report)."""
        waiting = set(self.ranks.pending)
        deadline = time.monotonic() + _BACKSTOP * self.timeout_s
        while time.monotonic() < deadline:
            events = self.ranks.wait(1.0)
            for event in events:
                if event.kind == "error":
                    self._fail(event.rank, f"raised:\n{event.value}")
                if event.kind == "died":
                    self._fail(event.rank, f"died (exit code {event.value})")
                if event.kind == "report" and isinstance(event.value, Heartbeat):
                    if self._on_heartbeat is not None:
                        self._on_heartbeat(event.rank, event.value.done)
                elif event.kind == "report":
                    queues[event.rank].append(event.value)
                    self._received[event.rank] += 1
            if events:
                return
        late = sorted(r for r in waiting if not queues[r])
        self._fail(late[0] if late else min(waiting),
                   f"sent nothing for {_BACKSTOP * self.timeout_s:g}s (ranks {late} are late)")

    def _fail(self, rank: int, what: str) -> NoReturn:
        doing = self._describe(self._received[rank])
        self.close()
        raise BenchError(f"rank {rank} of {self.world_size} {what}\n(while running: {doing})")

    def close(self) -> None:
        """Stop every rank (politely, then by force) and remove the rendezvous directory;
        finished ranks get a few seconds to tear down on their own."""
        self.ranks.close(grace_s=5.0 if self._finished else 0.0)
