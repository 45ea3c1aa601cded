"""Start local ranks, hear from them, stop them all: the one place disttrain starts ranks.

Two kinds of rank, started and stopped the same way (nothing outlives the parent):

* a **command** (``disttrain launch``): :class:`Worker`, a subprocess in a session of its
  own, so one ``killpg`` reaches it and everything it started, and a Ctrl-C in the
  terminal reaches only the launcher, which forwards what it catches
  (:func:`catching_signals`) and stops them all (:func:`stop_workers`). On Linux it is
  started through the exec wrapper :mod:`disttrain.launch.deathsig`, so it gets SIGTERM
  if the launcher dies. Its stdout and stderr are pipes, for the launcher to copy.
* a **Python function** (``disttrain run -n``, ``disttrain bench``, the simulator's
  probes): :class:`LocalRanks` runs ``target(rank, world_size, store, channel,
  *args[rank])`` in one new process per rank. The ranks meet through a ``file://`` store
  in a fresh temp dir (no port to clash with other jobs), removed on
  :meth:`LocalRanks.close`. Its :class:`RankChannel` streams reports to the parent; the
  return value or the traceback ends the rank's stream. The pipes carry pickles between
  this process and its own children only, never anything from the network. A rank
  ignores Ctrl-C (it is the parent's to handle), gets SIGKILL from the kernel if its
  parent dies (``PR_SET_PDEATHSIG``), and exits when the parent closes its control pipe;
  :meth:`LocalRanks.wait` names a rank that dies by number, with its exit code, and
  :meth:`LocalRanks.close` stops the rest (grace, SIGTERM and SIGCONT, then SIGKILL).

Where function ranks come from (``start``): ``"forkserver"`` (the default) forks them from
a server that imported torch once, which saves each rank about 3 s of a core; a fork
server's children inherit the environment it started with, so each rank adopts its
parent's environment of the moment first. ``"spawn"`` starts a fresh interpreter;
``"fork"`` copies the parent (for closures, which cannot be pickled). With
``DISTTRAIN_RANK_START=spawn`` the fork server is not used.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from disttrain.comm.liveness import STOPPED, process_state
from disttrain.launch.deathsig import set_parent_death_signal

PRELOAD = ("torch", "torch.distributed", "disttrain.comm")
START_VAR = "DISTTRAIN_RANK_START"  # "forkserver" (the default) or "spawn"
_TAIL_LINES = 40
_DEATHSIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deathsig.py")
_KILL_AFTER_S = 5.0  # after SIGTERM, how long a rank may take before SIGKILL
_POLL_S = 0.05
_STOPPED_WAKE_S = 2.0  # how long a stopped worker, woken by SIGCONT, may take to report
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# ------------------------------------------------------------------- where ranks come from
def rank_context(preload: Sequence[str] = PRELOAD) -> Any:
    """The multiprocessing context of ``start="forkserver"`` (see the module docstring).

    The fork server is one per process: ``preload`` counts only if it is not running yet,
    and a list set by someone else before is kept, with ``preload`` added to it."""
    method = os.environ.get(START_VAR, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_VAR} must be 'forkserver' or 'spawn', got {method!r}")
    if method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    from multiprocessing import forkserver

    current = list(getattr(forkserver._forkserver, "_preload_modules", []))
    ctx.set_forkserver_preload(current + [m for m in preload if m not in current])
    return ctx


def environment() -> dict[str, str]:
    """This process's environment now, to hand to a rank."""
    return dict(os.environ)


def adopt_environment(env: dict[str, str]) -> None:
    """In a rank: take the parent's environment as it was when the rank was started."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Ctrl-C is held back until the block ends, then delivered to the handler it would
    have reached (KeyboardInterrupt, as usual).

    Ctrl-C inside ``Process.start`` could leave a rank created but its pid never read, so
    it could not be stopped: it waited in its store's constructor for a directory already
    removed, holding the GIL, and kept the command's output pipes open for minutes. A
    signal mask would not do: this process has other threads, and the kernel hands SIGINT
    to any thread that does not block it. Python runs its handlers in the main thread, so
    a handler that only takes note defers Ctrl-C whichever thread received it."""
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


# ---------------------------------------------------------------------- function ranks
@dataclass(frozen=True)
class RankEvent:
    """What :meth:`LocalRanks.wait` heard: a ``"report"`` (``value``: what the rank sent),
    ``"done"`` (its return value), ``"error"`` (its traceback) or ``"died"`` (its exit
    code: it ended without a word)."""

    rank: int
    kind: str
    value: Any


def _exit_when_parent_leaves(control: Any) -> None:
    try:
        control.recv()  # the parent never sends: this returns (EOF) only when it is gone
    except (EOFError, OSError):
        pass
    os._exit(3)


class RankChannel:
    """A function rank's pipe to its parent: ``channel(report)`` sends a report;
    :meth:`fail` sends the exception being handled."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self.failed = False

    def __call__(self, report: Any) -> None:
        self._out.send(("report", report))

    def fail(self) -> None:
        """Send the traceback of the exception being handled, once. A rank whose clean-up
        may take long (closing a communicator whose peer is gone) calls it before."""
        if not self.failed:
            self.failed = True
            self._out.send(("error", traceback.format_exc()))


def _rank_entry(target: Callable[..., Any], rank: int, world_size: int, store: str,
                out: Any, control: Any, env: dict[str, str] | None, parent: int,
                args: tuple[Any, ...]) -> None:
    if env is not None:
        adopt_environment(env)
    # a fork server's child has the server as its parent, which ends with ours
    set_parent_death_signal(signal.SIGKILL, parent if parent > 0 else os.getppid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_exit_when_parent_leaves, args=(control,), daemon=True).start()
    channel = RankChannel(out)
    try:
        out.send(("done", target(rank, world_size, store, channel, *args)))
    except BaseException:
        channel.fail()


class LocalRanks:
    """One new process per entry of ``args`` running ``target`` (see the module
    docstring); started at construction, stopped by :meth:`close` (or the ``with`` block)."""

    def __init__(self, target: Callable[..., Any], args: Sequence[tuple[Any, ...]], *,
                 start: str = "forkserver", name: str = "disttrain-rank",
                 prefix: str = "disttrain-") -> None:
        if start not in ("forkserver", "spawn", "fork"):
            raise ValueError(f"start must be 'forkserver', 'spawn' or 'fork', got {start!r}")
        ctx = rank_context() if start == "forkserver" else mp.get_context(start)
        server = ctx.get_start_method() == "forkserver"
        self.world_size = len(args)
        self.processes: list[Any] = []
        self._outs: list[Any] = []
        self._controls: list[Any] = []
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self.store = os.path.join(self._tmp.name, "store")
        self.pending: set[int] = set()  # ranks whose stream has not ended
        try:
            for rank, rank_args in enumerate(args):
                self._start(ctx, target, rank, rank_args, name,
                            environment() if server else None, 0 if server else os.getpid())
        except BaseException:  # e.g. Ctrl-C while starting: stop the ranks already running
            self.close()
            raise

    def _start(self, ctx: Any, target: Callable[..., Any], rank: int,
               rank_args: tuple[Any, ...], name: str, env: dict[str, str] | None,
               parent: int) -> None:
        out_recv, out_send = ctx.Pipe(duplex=False)
        ctl_recv, ctl_send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_entry, daemon=True, name=f"{name}{rank}",
                           args=(target, rank, self.world_size, self.store, out_send,
                                 ctl_recv, env, parent, tuple(rank_args)))
        with ctrl_c_deferred():  # a rank whose start Ctrl-C cut short would run on unseen
            try:
                proc.start()
            except BaseException:  # never started: close() must not join it (that raises
                for conn in (out_recv, out_send, ctl_recv, ctl_send):  # an AssertionError
                    conn.close()  # hiding this error, e.g. a script without a __main__ guard)
                raise
            self.processes.append(proc)
            self._outs.append(out_recv)
            self._controls.append(ctl_send)
            self.pending.add(rank)
        out_send.close()
        ctl_recv.close()

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in enumerate(self.processes)}

    def exit_code(self, rank: int, wait_s: float = 0.0) -> int | None:
        self.processes[rank].join(wait_s)
        return self.processes[rank].exitcode  # type: ignore[no-any-return]

    def wait(self, timeout_s: float) -> list[RankEvent]:
        """What the pending ranks said or did within ``timeout_s`` (nothing: []). A rank
        whose process ended with nothing left in its pipe is reported ``"died"``."""
        outs = {self._outs[r]: r for r in self.pending}
        sentinels = {self.processes[r].sentinel: r for r in self.pending}
        events: list[RankEvent] = []
        ready = mpc.wait([*outs, *sentinels], timeout=max(0.0, timeout_s))
        for item in ready:
            if item in outs:
                rank = outs[item]
                kind: str
                try:
                    kind, value = self._outs[rank].recv()
                except EOFError:
                    kind, value = "died", self.exit_code(rank, 2.0)
                events.append(RankEvent(rank, kind, value))
                if kind != "report":
                    self.pending.discard(rank)
        for item in ready:
            rank = sentinels.get(item, -1)
            if rank in self.pending and item not in outs and not self._outs[rank].poll(0.5):
                self.pending.discard(rank)
                events.append(RankEvent(rank, "died", self.exit_code(rank)))
        return events

    def close(self, grace_s: float = 0.0) -> None:
        """Give the ranks ``grace_s`` to exit by themselves (a finished rank destroys its
        process group), then stop the rest: the control pipe closed, SIGTERM and SIGCONT
        (a stopped rank could not act on SIGTERM), SIGKILL after a few seconds. Removes
        the rendezvous directory."""
        deadline = time.monotonic() + grace_s
        for proc in self.processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for conn in self._controls:
            conn.close()
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + _KILL_AFTER_S
        for proc in self.processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._outs:
            conn.close()
        self._outs, self._controls, self.pending = [], [], set()
        self._tmp.cleanup()


# ------------------------------------------------------------------------ command ranks
def with_parent_death_signal(argv: Sequence[str]) -> list[str]:
    """``argv`` started through :mod:`disttrain.launch.deathsig` on Linux, so the worker gets
    SIGTERM when this process dies. (Not a ``preexec_fn``: running Python between fork and
    exec is unsafe in a process with threads, and the launcher has some.)"""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", _DEATHSIG, str(os.getpid()), *argv]


class Worker:
    """A running command rank and what the launcher knows about it."""

    def __init__(self, rank: int, local_rank: int, argv: Sequence[str],
                 env: Mapping[str, str]) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.error_file = env.get("DISTTRAIN_ERROR_FILE", "")
        # its last stderr lines, for the failure summary (kept by whoever reads its output)
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.returncode: int | None = None
        self.exited_at: float | None = None
        # No preexec_fn: the child runs no Python code before exec, so spawning is safe
        # whatever threads this process runs (and subprocess can use vfork).
        self.popen = subprocess.Popen(
            with_parent_death_signal(argv), env=dict(env), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self.popen.poll()
            if code is not None:
                self.returncode, self.exited_at = code, time.time()
        return self.returncode

    def alive(self) -> bool:
        return self.poll() is None

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker and everything in its process group.

        Once the worker is reaped its pid is free again, but its group id is not while a
        process it left behind is still in the group: the kernel reuses no pid that names
        a live group. So the group is still ours exactly when no process has that pid; if
        one does, the pid went to someone else (who may lead a group of their own, and as
        root the signal would reach it), and nothing is sent."""
        if self.returncode is not None and _pid_exists(self.popen.pid):
            return
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already

    def wait(self) -> int:
        code = self.popen.wait()
        self.poll()
        return code


class Signals:
    """SIGINT/SIGTERM/SIGHUP received by the launcher while it watches its workers (to be
    forwarded to them: a worker is in a session of its own and gets none from the terminal)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.event = threading.Event()

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        self.event.set()

    def wait(self, timeout_s: float) -> None:
        self.event.wait(timeout_s)


@contextlib.contextmanager
def catching_signals() -> Iterator[Signals]:
    caught = Signals()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _FORWARDED:
            previous[signum] = signal.signal(signum, caught.handler)
    try:
        yield caught
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def stop_workers(workers: list[Worker], signum: int, grace_s: float, caught: Signals) -> None:
    """``signum`` to every live worker's group, SIGKILL after ``grace_s`` (or at a second
    signal to the launcher), then SIGKILL every group so no descendant survives.

    SIGCONT follows the first signal (as systemd does): a stopped worker (SIGSTOP, a
    debugger) could not act on it and would cost the whole grace period. Once awake it
    writes its record (where it was stopped) and gets SIGKILL then, without the grace
    period: it is the culprit, and its shutdown would only delay the report."""
    alive = [w for w in workers if w.alive()]
    stopped = {w.rank for w in alive if process_state(w.pid) == STOPPED}
    for worker in alive:
        worker.signal_group(signum)
        if signum != signal.SIGCONT:
            worker.signal_group(signal.SIGCONT)
    already = len(caught.received)
    start = time.monotonic()
    deadline = start + grace_s
    while any(w.alive() for w in alive) and time.monotonic() < deadline:
        if len(caught.received) > already:
            break  # asked (again) to stop: do not wait any longer
        for worker in alive:
            if worker.rank in stopped and (os.path.exists(worker.error_file)
                                           or time.monotonic() > start + _STOPPED_WAKE_S):
                stopped.discard(worker.rank)
                worker.signal_group(signal.SIGKILL)
        caught.event.clear()
        caught.wait(_POLL_S)
    for worker in workers:
        worker.signal_group(signal.SIGKILL)
    for worker in workers:
        worker.wait()
