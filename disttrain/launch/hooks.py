"""Worker-side failure reporting, installed by ``disttrain.init()``: no rank dies silently.

* An uncaught exception writes the rank's **error record** (traceback, root cause) and its
  communicators' **flight-recorder dumps**, then prints as usual.
* SIGTERM (the launcher stopping survivors after another rank failed, or Slurm) raises
  :class:`WorkerTerminated`, a ``SystemExit`` with status 128+15 whose message names the rank
  that failed first, read from the launcher's failure notice. The record and dumps are
  written first.
* A rank blocked inside a C call (a Gloo wait) runs Python signal handlers only when the
  call returns. A watcher thread, woken through ``signal.set_wakeup_fd``, writes the record
  (with the main thread's stack) and the dumps the moment SIGTERM or SIGINT arrives, so even
  a rank that is then SIGKILLed leaves a diagnosis behind.
* At exit, communicators with unfinished or failed collectives are dumped too.
* **A rank whose launcher died ends.** The launcher's death sends SIGTERM (the kernel's
  parent-death signal); a rank blocked in a C call would never run the Python handler and
  no SIGKILL would follow, so the watcher thread ends the rank and its process group 2 s
  later when the launcher (``DISTTRAIN_LAUNCHER_PID``) is dead by then; a rank that exits
  first after a SIGTERM takes the processes it started along.
* **A failing rank's exit is bounded** (:func:`bound_exit`). Once an uncaught exception or
  SIGTERM ends the rank, it has ``exit_timeout_s`` (``DISTTRAIN_EXIT_TIMEOUT``, default 30 s)
  to finish exiting. Interpreter shutdown can block: a finalizer can join a thread that is
  still inside a timed-out Gloo operation, whose own timeout is the process group's
  (minutes), or a non-daemon thread may never end. Past the bound, faulthandler prints every
  thread's stack (headed ``Timeout (0:00:30)!``) and ends the process with status 1; should
  that watchdog already be gone (hangs after Python's own shutdown), SIGALRM kills the
  process a few seconds later. Either way the launcher sees the failure instead of waiting
  for a rank that has reported its error but never ends.

Hooks are process-wide by nature (``sys.excepthook``, signal handlers), so this module keeps
the one process-wide registry of communicators to dump; nothing else reads it.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

from disttrain.comm.liveness import DEAD, process_state
from disttrain.launch import records
from disttrain.launch.env import DEFAULT_EXIT_TIMEOUT_S

log = logging.getLogger(__name__)

_NOTICE_WAIT_S = 1.0  # how long a rank that lost a peer waits for the launcher's notice
_ALARM_AFTER_S = 5.0  # the SIGALRM backstop, after the faulthandler watchdog's bound
_ORPHAN_EXIT_S = 2.0  # a rank whose launcher died ends this long after its SIGTERM


class WorkerTerminated(SystemExit):
    """A signal stopped this rank. Exit status 128 + signal, like a process killed by it;
    ``except Exception`` does not swallow it."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass
class _State:
    rank: int
    env: Mapping[str, str]
    host: str = field(default_factory=socket.gethostname)
    comms: list[weakref.ref[Any]] = field(default_factory=list)
    failing: bool = False
    dumped: bool = False
    exit_timeout_s: float = DEFAULT_EXIT_TIMEOUT_S
    exit_bounded: bool = False
    orphan_watch: bool = False  # SIGTERM came: watching for a dead launcher
    alarm_before: Any = None  # SIGALRM's handler and timer before bound_exit, for release
    lock: threading.Lock = field(default_factory=threading.Lock)


_state: _State | None = None


def install(comm: Any | None, rank: int, env: Mapping[str, str] | None = None, *,
            exit_timeout_s: float = DEFAULT_EXIT_TIMEOUT_S) -> None:
    """Report failures of this process (rank ``rank``), dump ``comm``'s flight recorder, and
    give a failing process ``exit_timeout_s`` to exit (0: no bound; see :func:`bound_exit`).
    ``comm`` may come later (:func:`register`): the hooks also report a failure to join."""
    global _state
    if _state is None:
        _state = _State(rank, os.environ if env is None else env)
        _chain_excepthook()
        atexit.register(_at_exit)
        _install_signal_handlers()
    _state.rank = rank
    _state.exit_timeout_s = exit_timeout_s
    if comm is not None:
        register(comm)


def is_failing() -> bool:
    """Whether this process is on its way out because of an uncaught error or SIGTERM."""
    return _state is not None and _state.failing


def bound_exit() -> bool:
    """This process is ending (on an error, or in disttrain's exit handler): stop it if it
    is still alive ``exit_timeout_s`` from now. Then faulthandler writes every thread's
    stack to stderr (where the exit is stuck) and exits with status 1; ``_ALARM_AFTER_S``
    later SIGALRM, at its default action, kills the process in case that watchdog has
    already been shut down with the interpreter. There is one faulthandler watchdog and one
    real-time timer per process: this replaces the user's, and cancelling theirs cancels
    this one's stack dump (the SIGALRM backstop remains unless they reset the timer).
    Does nothing in an interactive session (an uncaught error there does not end it), with
    a bound of 0, or a second time. Returns whether the bound was set."""
    state = _state
    if state is None or state.exit_bounded or state.exit_timeout_s <= 0 \
            or hasattr(sys, "ps1") or sys.flags.interactive:
        return False
    stream = sys.__stderr__ or sys.stderr
    try:
        if stream is None:
            raise ValueError("no stderr to write the stacks to")
        faulthandler.dump_traceback_later(state.exit_timeout_s, exit=True, file=stream)
    except (AttributeError, OSError, RuntimeError, ValueError) as exc:  # no usable stderr
        log.warning("rank %d: cannot bound its exit with faulthandler (%s); SIGALRM only",
                    state.rank, exc)
    handler = None
    if threading.current_thread() is threading.main_thread():  # signal() needs it
        handler = signal.signal(signal.SIGALRM, signal.SIG_DFL)
    timer = signal.setitimer(signal.ITIMER_REAL, state.exit_timeout_s + _ALARM_AFTER_S)
    state.alarm_before = (handler, timer)
    state.exit_bounded = True
    return True


def release_exit_bound() -> None:
    """Undo :func:`bound_exit`, giving SIGALRM its handler and timer back (after disttrain's
    exit handler shut down in time: the rest of a normal exit, e.g. a user's own exit
    handlers, is not this module's to bound; faulthandler's watchdog is one per process and
    stays cancelled)."""
    if _state is None or not _state.exit_bounded:
        return
    faulthandler.cancel_dump_traceback_later()
    handler, (delay, interval) = _state.alarm_before
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, handler)  # first: a timer about to fire finds it
    signal.setitimer(signal.ITIMER_REAL, delay, interval)  # the user's timer, if any, again
    _state.exit_bounded = False


def register(comm: Any) -> None:
    """Also dump ``comm`` (e.g. a sub-communicator from ``new_group``) when this rank fails."""
    if _state is not None and all(ref() is not comm for ref in _state.comms):
        _state.comms.append(weakref.ref(comm))


def dump_flight_recorders(reason: str) -> list[str]:
    """Write every registered communicator's flight recorder; returns the paths."""
    if _state is None:
        return []
    paths = []
    comms = [c for c in (ref() for ref in _state.comms) if c is not None]
    for index, comm in enumerate(comms):
        try:  # the path too: a private directory that is not private is refused
            path = records.flight_file(_state.rank, _state.env, index)
            comm.flight_recorder.write(path, rank=_state.rank, host=_state.host, pid=os.getpid(),
                                       reason=reason, time=time.time())
            paths.append(str(path))
        except OSError as exc:
            log.warning("could not write the flight recorder of rank %d: %s", _state.rank, exc)
    _state.dumped = _state.dumped or bool(paths)
    return paths


def record_failure(exc: BaseException, *, kind: str = "exception",
                   stack: str | None = None) -> records.ErrorRecord | None:
    """Dump the flight recorders and write this rank's error record; never raises."""
    state = _state
    if state is None:
        return None
    try:
        with state.lock:
            already = state.dumped
            flights = dump_flight_recorders(f"{type(exc).__name__}: {exc}")
            root = _root_cause(exc)
            if root and root not in str(exc) and hasattr(exc, "add_note"):
                exc.add_note(f"root cause (from disttrain launch): {root}")  # shown below it
            text = stack if stack is not None else "".join(
                traceback.format_exception(type(exc), exc, exc.__traceback__))
            suspects = tuple(int(r) for r in getattr(exc, "suspects", ()) or ())
            record = records.ErrorRecord(
                f"{type(exc).__name__}: {exc}", text, time.time(), kind, state.rank,
                state.host, os.getpid(), flights[0] if flights else None, root, suspects)
            for path in _error_files(kind):
                records.write_json(path, record.to_json())
            if flights and not already:
                log.error("rank %d: flight recorder written to %s", state.rank,
                          ", ".join(flights))
            return record
    except Exception as err:  # reporting must never hide the original error
        log.warning("could not record the failure of rank %d: %s", state.rank, err)
        return None


def _error_files(kind: str) -> list[str]:
    assert _state is not None
    names = [records.ERROR_FILE_VAR]
    if kind == "exception":  # torchrun picks its root cause by these files' timestamps:
        names.append(records.TORCH_ERROR_FILE_VAR)  # a terminated survivor must not compete
    return sorted({_state.env[n] for n in names if _state.env.get(n)})


def _root_cause(exc: BaseException) -> str | None:
    """The launcher's notice when another rank failed first (waiting briefly for it when
    this error says a peer died, since the launcher may not have noticed yet)."""
    assert _state is not None
    from disttrain.comm.errors import PeerFailedError

    run_dir = _state.env.get(records.RUN_DIR_VAR)
    wait = _NOTICE_WAIT_S if isinstance(exc, PeerFailedError) else 0.0
    notice = records.wait_for_failure_notice(run_dir, wait)
    if notice is None or notice.rank == _state.rank:
        return None
    return notice.describe()


# ------------------------------------------------------------------- uncaught exceptions
def _chain_excepthook() -> None:
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException,
             tb: TracebackType | None) -> None:
        if _state is not None:
            _state.failing = True
            if threading.current_thread() is threading.main_thread():  # the process ends
                bound_exit()  # first: the reporting below must not hang either
            record_failure(exc)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _at_exit() -> None:
    """Dump communicators that still have unfinished or failed collectives; after SIGTERM,
    take along what this rank started (see :func:`_end_if_orphaned`)."""
    if _state is not None and _state.orphan_watch:
        _kill_descendants()
    if _state is None or _state.dumped:
        return
    for comm in (ref() for ref in _state.comms):
        if comm is not None and any(r["state"] != "completed"
                                    for r in comm.flight_recorder.dump()):
            dump_flight_recorders("exit with unfinished or failed collectives")
            return


# ------------------------------------------------------------------- signals
def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # Python only lets the main thread install handlers
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)
    _start_watcher()


def termination_message(signum: int) -> str:
    assert _state is not None
    name = signal.Signals(signum).name
    notice = records.read_failure_notice(_state.env.get(records.RUN_DIR_VAR))
    if notice is not None and notice.rank != _state.rank:
        return f"rank {_state.rank} was stopped ({name}) because {notice.describe()}"
    return f"rank {_state.rank} received {name} (from its launcher, the scheduler or a user)"


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _end_if_orphaned()
    if _state is None or _state.failing:
        return  # already reporting an error: let it finish (the launcher's grace is bounded)
    _state.failing = True
    bound_exit()
    error = WorkerTerminated(signum, termination_message(signum))
    stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
    record_failure(error, kind="terminated", stack=f"{stack}{type(error).__name__}: {error}\n")
    log.error("%s", error)
    raise error


def _start_watcher() -> None:
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        previous = None
    if previous != -1:  # someone else (e.g. asyncio) owns the wakeup fd: leave it to them
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    threading.Thread(target=_watch, args=(read_fd,), name="disttrain-signal-watch",
                     daemon=True).start()


def _end_if_orphaned() -> None:
    """On SIGTERM: if the launcher turns out to be gone (the signal is the kernel's
    parent-death signal, set by :mod:`disttrain.launch.deathsig`), nobody will send the
    SIGKILL that ends a rank stuck in a C call, where the Python handler never runs, nor
    stop what the rank started. So the rank ends itself and its process group
    ``_ORPHAN_EXIT_S`` after the signal (time enough to write its record) when the launcher
    is gone by then, and takes its children along if it exits first (:func:`_at_exit`).
    It looks again after the delay because the kernel sends the signal as soon as the
    launcher's *thread* that started the worker has died, while the launcher's other
    threads still run (and are still the worker's parent). Where the launcher is gone
    already, what the rank started is killed at once, so that it does not depend on the
    rank living through the delay (a rank can end sooner, by its own exit or a crash)."""
    state = _state
    if state is None or not state.env.get(records.LAUNCHER_PID_VAR):
        return
    if _launcher_gone():
        _kill_descendants()
    if state.orphan_watch:
        return
    state.orphan_watch = True

    def end() -> None:
        time.sleep(_ORPHAN_EXIT_S)
        if _launcher_gone():
            log.error("rank %d: its launcher is gone; ending it and what it started",
                      state.rank)
            _kill_own_group()

    threading.Thread(target=end, name="disttrain-orphan-exit", daemon=True).start()


def _launcher_gone() -> bool:
    """Whether this worker's launcher ($DISTTRAIN_LAUNCHER_PID) is dead: no longer its
    parent, or dying (the thread that started the worker is gone, which leaves the process
    a zombie leader while its other threads end)."""
    launcher = _state.env.get(records.LAUNCHER_PID_VAR, "") if _state is not None else ""
    if not launcher.isdigit():
        return False
    return os.getppid() != int(launcher) or process_state(int(launcher)) == DEAD


def _kill_descendants() -> None:
    """SIGKILL every process this one started (and theirs): a rank ending on SIGTERM takes
    them along. With its launcher alive that changes nothing (the launcher kills the rank's
    process group right after); with the launcher dead (its death is the SIGTERM, and
    whether it is complete yet cannot be told from here) nobody else would."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    todo = [os.getpid()]
    while todo:
        parent = todo.pop()
        for pid in [p for p, pp in parents.items() if pp == parent]:
            todo.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _kill_own_group() -> None:
    """SIGKILL this process and everything it started: its descendants by parent (also
    those that left its process group) and, when it leads its process group (the launcher
    starts every worker as one), the rest of the group."""
    _kill_descendants()
    group = os.getpgrp()
    if group == os.getpid():
        os.killpg(group, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(read_fd: int) -> None:
    """Record where the main thread is the moment SIGTERM/SIGINT arrives (it may be blocked
    in C and run its handler only much later, or be SIGKILLed first)."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum == signal.SIGTERM:
                _end_if_orphaned()
            if signum in (signal.SIGTERM, signal.SIGINT) and _state is not None \
                    and not _state.failing:
                frame = sys._current_frames().get(threading.main_thread().ident or -1)
                stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
                error = WorkerTerminated(signum, termination_message(signum))
                record_failure(error, kind="terminated",
                               stack=f"{stack}(main thread when {signal.Signals(signum).name} "
                                     f"arrived)\n{type(error).__name__}: {error}\n")
