"""``disttrain launch``: start the workers of one node, watch them, stop them all together.

    rendezvous store ─┐ (node rank 0 only, like torchrun's agent store; listening on
                      │  127.0.0.1, or on --master-addr across nodes: store.py)
                      ▼
    spawn N workers ──► watch every 50 ms ──► all exited 0 ─────────────► exit 0
      (torchrun env)      │                   (with --tolerate-worker-loss: all the others,
                          │                    a lost worker announced when seen)
                          │                ──► a worker failed: 0.5 s for the others
                          │                    to exit by themselves ──┐
                          │                                            ▼
                          └─ SIGINT/SIGTERM ─► forward ──► failure notice, SIGTERM (and
                                                           SIGCONT) the others, SIGKILL after
                                                           the grace period, report the root
                                                           cause, exit with its code

The store lives in the launcher rather than in rank 0, so it outlives any worker: when a
rank dies, the survivors can still check in through it and name the dead one. Every worker
and whatever it started is killed through its process group before the launcher returns,
and the shared-memory segments its ranks created (tagged with $DISTTRAIN_SHM_TAG) are
removed if a rank died before it could.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from disttrain.comm.liveness import STOPPED, process_state
from disttrain.comm.transports.shm_segment import SHM_TAG_VAR, unlink_tagged
from disttrain.launch import records, store, summary
from disttrain.launch.config import LaunchConfig
from disttrain.launch.env import LOOPBACK, worker_env
from disttrain.launch.ranks import Worker

log = logging.getLogger(__name__)
SERVERS_VAR = "DISTTRAIN_PS_SERVERS"  # read by parallel.parameter_server.servers_from_env
RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"  # torchrun's names; `disttrain run` resumes
MAX_RESTARTS_VAR = "TORCHELASTIC_MAX_RESTARTS"  # when the count is > 0

_POLL_S = 0.05
_SETTLE_S = 0.5  # after a failure, how long the others may take to exit by themselves
_STOPPED_WAKE_S = 2.0  # how long a stopped worker, woken by SIGCONT, may take to report
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class _Outcome:
    kind: str  # "success", "failure" or "signal"
    root: summary.Blame | None = None
    signum: int | None = None


class _Signals:
    """Catches SIGINT/SIGTERM/SIGHUP for the launcher's main loop."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.event = threading.Event()

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        self.event.set()

    def wait(self, timeout_s: float) -> None:
        self.event.wait(timeout_s)


@contextmanager
def _catching_signals() -> Iterator[_Signals]:
    caught = _Signals()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _FORWARDED:
            previous[signum] = signal.signal(signum, caught.handler)
    try:
        yield caught
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def _host_store(config: LaunchConfig, timeout_s: float) -> tuple[Any | None, int]:
    """Node rank 0 hosts the rendezvous store, listening on one address only (see
    :mod:`disttrain.launch.store`); returns (store, port)."""
    if not config.hosts_store:
        assert config.master_port is not None
        return None, config.master_port
    listener = store.open_listener(store.bind_address(config), config.master_port or 0)
    port = int(listener.getsockname()[1])
    return store.host_store(listener, timeout_s), port


def _spawn(config: LaunchConfig, port: int, run_dir: str, shm_tag: str,
           workers: list[Worker], restart_count: int = 0) -> None:
    """Start every worker, appending each to ``workers`` as it starts (so a failure half way
    still lets the caller stop the ones already running)."""
    addr = config.master_addr or LOOPBACK
    local = config.local_processes  # with --servers (one node only): workers + servers
    for local_rank in range(local):
        rank = config.node_rank * local + local_rank
        error_file = os.path.join(run_dir, f"error-rank{rank}.json")
        extra = {records.RUN_DIR_VAR: run_dir, records.ERROR_FILE_VAR: error_file,
                 records.TORCH_ERROR_FILE_VAR: error_file,
                 records.LAUNCHER_PID_VAR: str(os.getpid()), SHM_TAG_VAR: shm_tag,
                 RESTART_COUNT_VAR: str(restart_count),
                 MAX_RESTARTS_VAR: str(config.max_restarts), **_role_env(config, rank)}
        if not os.environ.get(records.FLIGHT_DIR_VAR):
            extra[records.FLIGHT_DIR_VAR] = run_dir
        env = worker_env(os.environ, local_rank=local_rank, nproc_per_node=local,
                         nnodes=config.nnodes, node_rank=config.node_rank, master_addr=addr,
                         master_port=port, extra=extra)
        workers.append(Worker(rank, local_rank, config.command(), env))


def _role_env(config: LaunchConfig, rank: int) -> dict[str, str]:
    """With ``--servers S``: DISTTRAIN_PS_SERVERS, and torchrun's role variables saying
    whether this rank is a worker or a server (ROLE_RANK counts within the role)."""
    if not config.servers:
        return {}
    workers = config.nproc_per_node
    role, index, size = ("worker", rank, workers) if rank < workers else (
        "server", rank - workers, config.servers)
    return {SERVERS_VAR: str(config.servers), "ROLE_NAME": role, "ROLE_RANK": str(index),
            "ROLE_WORLD_SIZE": str(size)}


def _watch(workers: list[Worker], caught: _Signals, run_dir: str, host: str,
           losable: frozenset[int] = frozenset()) -> _Outcome:
    """Until every worker exited, one failed, or a signal came. The failure of a rank in
    ``losable`` (``--tolerate-worker-loss``) is announced and the others go on; it is still
    a candidate for the root cause if another rank fails afterwards."""
    lost: set[int] = set()
    while True:
        if caught.received:
            return _Outcome("signal", signum=caught.received[0])
        for worker in workers:
            worker.poll()
        failures = summary.failures(workers)
        for failure in failures:
            if failure.rank in losable and failure.rank not in lost:
                lost.add(failure.rank)
                _say(f"{describe_loss(failure)}; the job goes on without it "
                     f"(--tolerate-worker-loss)")
        if any(f.rank not in losable for f in failures):
            _settle(workers, caught)
            root = summary.blame(summary.first_failure(summary.failures(workers)), workers)
            # Written before the others are signalled, so their last words can name it.
            records.write_failure_notice(run_dir, summary.notice_for(root, host))
            return _Outcome("failure", root=root)
        if all(w.returncode is not None for w in workers):
            return _Outcome("success")
        caught.wait(_POLL_S)


def describe_loss(failure: summary.Failure) -> str:
    """``worker rank 1 was killed by SIGKILL`` / ``… exited with code 1 (PSError: …)``."""
    worker = failure.worker
    assert worker.returncode is not None
    message = " ".join(failure.record.message.split())[:200] if failure.record else ""
    return f"worker rank {worker.rank} {summary.describe_exit(worker.returncode)}" + (
        f" ({message})" if message else "")


def _say(line: str) -> None:
    print(f"disttrain launch: {line}", file=sys.stderr, flush=True)


def _settle(workers: list[Worker], caught: _Signals) -> None:
    """After a first failure, give the other workers up to ``_SETTLE_S`` to exit by
    themselves before they are stopped. Ranks that fail at the same moment (every rank
    raising the same collective mismatch) then end with their own error records instead
    of a termination, and the root cause is chosen among all of them. Survivors blocked on
    the failed rank do not exit by themselves: they are stopped ``_SETTLE_S`` later."""
    deadline = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline and not caught.received:
        for worker in workers:
            worker.poll()
        if all(w.returncode is not None for w in workers):
            return
        caught.wait(_POLL_S)


def _stop(workers: list[Worker], signum: int, grace_s: float, caught: _Signals) -> None:
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


def launch(config: LaunchConfig, restart_count: int = 0,
           on_failure: Callable[[summary.Blame], None] | None = None) -> int:
    """Run the job's workers on this node once; return the launcher's exit code.
    ``restart_count`` is told to the workers; ``on_failure`` receives whom a failed run
    blames (:func:`disttrain.launch.restarts.launch_with_restarts` uses both)."""
    host = socket.gethostname()
    rendezvous, port = _host_store(config, timeout_s=600.0)
    own_dir = config.run_dir is None
    run_dir = tempfile.mkdtemp(prefix="disttrain-run-") if own_dir else str(config.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    lock = threading.Lock()
    workers: list[Worker] = []
    shm_tag = f"l{os.getpid():x}{secrets.token_hex(3)}"  # names its ranks' segments
    with _catching_signals() as caught:
        try:
            _spawn(config, port, run_dir, shm_tag, workers, restart_count)
            for worker in workers:
                worker.start_output(lock, config.prefix_output)
            outcome = _watch(workers, caught, run_dir, host, config.losable_ranks)
        finally:  # also when spawning or watching raised: nothing may outlive the launcher
            _stop(workers, (caught.received or [signal.SIGTERM])[0], config.grace_s, caught)
            left = unlink_tagged(shm_tag)  # a rank killed during shared-memory set-up
            if left:
                log.warning("removed shared-memory segment(s) a dead rank left: %s", left)
    for worker in workers:
        worker.join_output(2.0)
    code, report = _conclude(outcome, workers, host, run_dir)
    if on_failure is not None and outcome.root is not None:
        on_failure(outcome.root)
    if report:
        with lock:
            print(report, file=sys.stderr, flush=True)
    if code == 0 and own_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    del rendezvous  # the store outlived every worker
    return code


def _conclude(outcome: _Outcome, workers: list[Worker], host: str,
              run_dir: str) -> tuple[int, str]:
    if outcome.kind == "success":
        return 0, ""
    if outcome.kind == "signal":
        assert outcome.signum is not None
        name = signal.Signals(outcome.signum).name
        return 128 + outcome.signum, (f"disttrain launch: received {name}; forwarded it to "
                                      f"{len(workers)} worker(s) and stopped them (files: "
                                      f"{run_dir})")
    assert outcome.root is not None
    first = outcome.root.failure.worker
    assert first.returncode is not None
    reread = summary.Failure(first,  # re-read: the record may be complete now
                             records.read_error_record(first.error_file))
    culprit = dataclasses.replace(outcome.root, failure=reread)
    return (summary.exit_code(first.returncode),
            summary.format_report(culprit, workers, host, run_dir))
