"""Start local ranks for a benchmark, stream their reports back, and never leave one behind.

``RankGroup(world_size, job, args)`` starts ``world_size`` new processes (forked from a
server that imported torch once: :mod:`~disttrain.bench.forkserver`) that rendezvous over
Gloo through a ``file://`` store in a fresh temp dir (no ports to clash) and run
``job(comm, emit, *args)`` with a :class:`~disttrain.comm.Communicator`. Each call of
``emit(payload)`` on a rank is one report; :meth:`RankGroup.reports` yields, in order, the
list of every rank's k-th payload (rank order). The pipes carry pickles between this process
and its own children only.

Nothing hangs: ranks' own waits time out (``timeout_s``), a rank that dies or raises is
reported by number with its traceback, the parent gives up after ``4·timeout_s`` without
any report, and ranks exit when the parent goes away. Leaving the ``with`` block (normally,
on an error or on Ctrl-C) terminates every rank and removes the temp dir.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.connection as mpc
import os
import signal
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from disttrain.bench.forkserver import adopt_environment, environment, rank_context
from disttrain.bench.transports import make_communicator

Job = Callable[..., None]
_BACKSTOP = 4.0  # the parent waits this many rank timeouts for a report before giving up


class BenchError(RuntimeError):
    """A benchmark rank failed, died or stopped reporting; the message names it."""


def _exit_when_parent_leaves(control: Any) -> None:
    try:
        control.recv()  # the parent never sends: this returns (EOF) only when it is gone
    except (EOFError, OSError):
        pass
    os._exit(3)


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Ctrl-C is held back until the block ends, then delivered to the handler it would
    have reached (KeyboardInterrupt, as usual).

    Ctrl-C inside ``Process.start`` could leave a rank created by the fork server but its
    pid never read, so :meth:`RankGroup.close` could not stop it. Such a rank then waited
    in its ``file://`` store's constructor for a directory that close() had removed,
    holding the GIL, so it could not even notice that the parent had gone; it kept the
    command's output pipes open for minutes (``test_ctrl_c_stops_every_rank``, 2 runs in
    8). A signal mask would not do: this process has other threads, and the kernel hands
    SIGINT to any thread that does not block it. Python runs its handlers in the main
    thread, so a handler that only takes note defers Ctrl-C whichever thread received it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if noted:
            signal.raise_signal(signal.SIGINT)  # now to the previous handler


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


def _rank_main(out: Any, control: Any, env: dict[str, str], rank: int, world_size: int,
               store: str, transport: str, timeout_s: float, job: Job, args: tuple[Any, ...],
               cores: tuple[int, ...] | None, threads: int, backend: str = "gloo",
               device: str = "cpu") -> None:
    adopt_environment(env)
    if cores is not None:  # first, so every thread the rank starts (Gloo's too) inherits it
        os.sched_setaffinity(0, set(cores))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_exit_when_parent_leaves, args=(control,), daemon=True).start()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # torch 2.13 deprecates the *_into_tensor names that native collectives call: not news to
    # someone reading a benchmark table, so keep it out of the ranks' output
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*torch\.distributed\.\w+` is deprecated")
    comm = None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)  # 1 unless told: ranks share the machine's cores
        if device != "cpu":  # cuda:rank (every rank here is local), before NCCL starts
            from disttrain.train.device import select_local_gpu

            select_local_gpu(device, rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        comm = make_communicator(transport, timeout_s)
        job(comm, lambda payload: out.send(("report", payload)), *args)
        out.send(("done", None))
    except BaseException:
        out.send(("error", traceback.format_exc()))
    finally:
        if comm is not None:
            comm.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class RankGroup:
    """``world_size`` local ranks running one job; use as a context manager."""

    def __init__(self, world_size: int, job: Job, args: tuple[Any, ...], *, transport: str,
                 timeout_s: float, describe: Callable[[int], str] = str,
                 bind_cores: bool = False, threads: int = 1, backend: str = "gloo",
                 device: str = "cpu") -> None:
        """``bind_cores``: pin rank r to one core of its own (:func:`bind_plan`), as
        DeepSpeed's ``--bind_cores_to_rank`` does; otherwise the kernel may keep two ranks
        on one core for a whole run while the other idles, which makes runs bimodal.
        ``threads``: intra-op threads of every rank (bound: that many cores each).
        ``backend`` and ``device`` (``disttrain.train.device``): rank r on ``cuda:r``."""
        if threads < 1:
            raise ValueError(f"threads must be ≥ 1, got {threads}")
        self.world_size, self.timeout_s, self._describe = world_size, timeout_s, describe
        self._tmp = tempfile.TemporaryDirectory(prefix="disttrain-bench-")
        store = os.path.join(self._tmp.name, "store")
        ctx = rank_context()
        self._procs: list[Any] = []
        self._outs: list[Any] = []
        self._controls: list[Any] = []
        self._finished = False
        self._received = [0] * world_size  # reports received from each rank so far
        cores = thread_cores(world_size, threads) if bind_cores else None
        try:
            for rank in range(world_size):
                self._start(ctx, (rank, world_size, store, transport, timeout_s, job, args,
                                  None if cores is None else cores[rank], threads, backend,
                                  device))
        except BaseException:  # e.g. Ctrl-C while starting: stop the ranks already running
            self.close()
            raise

    def _start(self, ctx: Any, rank_args: tuple[Any, ...]) -> None:
        """Start one rank: ``_rank_main(out, control, *rank_args)``."""
        out_recv, out_send = ctx.Pipe(duplex=False)
        ctl_recv, ctl_send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, daemon=True,
                           name=f"disttrain-bench-r{rank_args[0]}",
                           args=(out_send, ctl_recv, environment(), *rank_args))
        with _ctrl_c_deferred():  # a rank whose start Ctrl-C cut short would run on unseen
            try:
                proc.start()
            except BaseException:  # never started: close() must not join it (that raises an
                for conn in (out_recv, out_send, ctl_recv, ctl_send):  # AssertionError
                    conn.close()  # hiding this error, e.g. a script without a __main__ guard)
                raise
            self._procs.append(proc)
            self._outs.append(out_recv)
            self._controls.append(ctl_send)
        out_send.close()
        ctl_recv.close()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reports(self) -> Iterator[list[Any]]:
        """Every rank's k-th report, for k = 0, 1, …, until all ranks are done."""
        queues: list[list[Any]] = [[] for _ in range(self.world_size)]
        done: set[int] = set()
        while len(done) < self.world_size:
            while all(queues[r] for r in range(self.world_size)):
                yield [queues[r].pop(0) for r in range(self.world_size)]
            self._receive(queues, done)
        self._finished = True
        if any(queues):
            raise BenchError("ranks finished with different numbers of reports: "
                             f"{[len(q) for q in queues]} left over")

    def _receive(self, queues: list[list[Any]], done: set[int]) -> None:
        """Wait for the next message from any rank; raise on error, death or silence, naming
        the rank and what it was doing (its next report)."""
        waiting = {self._outs[r]: r for r in range(self.world_size) if r not in done}
        sentinels = {self._procs[r].sentinel: r for r in waiting.values()}
        deadline = time.monotonic() + _BACKSTOP * self.timeout_s
        while time.monotonic() < deadline:
            ready: list[Any] = mpc.wait([*waiting, *sentinels], timeout=1.0)
            for item in ready:
                if item in waiting:
                    rank = waiting[item]
                    try:
                        kind, payload = item.recv()
                    except EOFError:
                        self._procs[rank].join(2)
                        self._fail(rank, f"died (exit code {self._procs[rank].exitcode})")
                    if kind == "error":
                        self._fail(rank, f"raised:\n{payload}")
                    if kind == "done":
                        done.add(rank)
                    else:
                        queues[rank].append(payload)
                        self._received[rank] += 1
                    return
            for item in ready:
                rank = sentinels[item] if item in sentinels else -1
                if rank >= 0 and not self._outs[rank].poll(0.5):
                    self._fail(rank, f"died (exit code {self._procs[rank].exitcode})")
        late = sorted(r for r in waiting.values() if not queues[r])
        self._fail(late[0] if late else min(waiting.values()),
                   f"sent nothing for {_BACKSTOP * self.timeout_s:g}s (ranks {late} are late)")

    def _fail(self, rank: int, what: str) -> NoReturn:
        doing = self._describe(self._received[rank])
        self.close()
        raise BenchError(f"rank {rank} of {self.world_size} {what}\n(while running: {doing})")

    def close(self) -> None:
        """Stop every rank (politely, then by force) and remove the rendezvous directory."""
        for conn in self._controls:
            conn.close()
        for proc in self._procs:
            if self._finished:  # done ranks are tearing down on their own
                proc.join(5)
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(3)
            if proc.is_alive():
                proc.kill()
                proc.join(3)
        for conn in self._outs:
            conn.close()
        self._procs, self._outs, self._controls = [], [], []
        self._tmp.cleanup()
