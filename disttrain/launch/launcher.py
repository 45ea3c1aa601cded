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

import collections
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from disttrain.comm.transports.shm.segment import SHM_TAG_VAR, unlink_tagged
from disttrain.launch import records, store, summary
from disttrain.launch.config import LaunchConfig
from disttrain.launch.env import LOOPBACK, worker_env
from disttrain.launch.ranks import Signals, Worker, catching_signals, stop_workers

log = logging.getLogger(__name__)
SERVERS_VAR = "DISTTRAIN_PS_SERVERS"  # read by parallel.parameter_server.servers_from_env
RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"  # torchrun's names; `disttrain run` resumes
MAX_RESTARTS_VAR = "TORCHELASTIC_MAX_RESTARTS"  # when the count is > 0

_POLL_S = 0.05
_SETTLE_S = 0.5  # after a failure, how long the others may take to exit by themselves


@dataclass
class _Outcome:
    kind: str  # "success", "failure" or "signal"
    root: summary.Blame | None = None
    signum: int | None = None


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


def _watch(workers: list[Worker], caught: Signals, run_dir: str, host: str,
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


def _settle(workers: list[Worker], caught: Signals) -> None:
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
    readers: list[tuple[threading.Thread, ...]] = []
    shm_tag = f"l{os.getpid():x}{secrets.token_hex(3)}"  # names its ranks' segments
    with catching_signals() as caught:
        try:
            _spawn(config, port, run_dir, shm_tag, workers, restart_count)
            readers += [_copy_output(worker, lock, config.prefix_output) for worker in workers]
            outcome = _watch(workers, caught, run_dir, host, config.losable_ranks)
        finally:  # also when spawning or watching raised: nothing may outlive the launcher
            stop_workers(workers, (caught.received or [signal.SIGTERM])[0], config.grace_s, caught)
            left = unlink_tagged(shm_tag)  # a rank killed during shared-memory set-up
            if left:
                log.warning("removed shared-memory segment(s) a dead rank left: %s", left)
    deadline = time.monotonic() + 2.0
    for thread in (t for pair in readers for t in pair):
        thread.join(max(0.0, deadline - time.monotonic()))
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


def _copy_output(worker: Worker, lock: threading.Lock,
                 prefix: bool) -> tuple[threading.Thread, ...]:
    """Threads copying the worker's output to ours line by line, each line prefixed
    ``[rank R] `` if asked, its last stderr lines kept for the failure summary (start them
    after every worker is spawned)."""
    tag = f"[rank {worker.rank}] ".encode() if prefix else b""
    assert worker.popen.stdout is not None and worker.popen.stderr is not None
    threads = tuple(threading.Thread(target=_pump, args=(stream, sink, tag, tail, lock),
                                     name=f"disttrain-out-r{worker.rank}", daemon=True)
                    for stream, sink, tail in (
                        (worker.popen.stdout, sys.stdout, None),
                        (worker.popen.stderr, sys.stderr, worker.stderr_tail)))
    for thread in threads:
        thread.start()
    return threads


def _pump(stream: IO[bytes], sink: IO[str], tag: bytes,
          tail: collections.deque[str] | None, lock: threading.Lock) -> None:
    out = getattr(sink, "buffer", None)
    for raw in iter(stream.readline, b""):
        line = raw if raw.endswith(b"\n") else raw + b"\n"
        if tail is not None:
            tail.append(line.decode(errors="replace"))
        with lock:
            try:
                if out is not None:
                    sink.flush()
                    out.write(tag + line)
                    out.flush()
                else:
                    sink.write((tag + line).decode(errors="replace"))
                    sink.flush()
            except (OSError, ValueError):
                pass  # our own output is closed (e.g. a broken pipe): keep draining
    stream.close()


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
