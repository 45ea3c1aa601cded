"""The launcher's report when a run fails: who failed first, how, and where each rank was.

The first failure is the first worker the launcher saw exit with an error; among workers
seen in the same poll, one that failed on its own beats one that only reports a dead peer
or was terminated, then the earliest error record. When that first failure is only a
consequence (a survivor's timeout) and its communicator named the ranks to blame, those
are the culprit (:func:`blame`): a rank that fell silent (stopped, or stuck) never exits by
itself, so it is never the first to fail. The report shows the culprit's host, how it
ended (exit code, signal, or stopped), the tail of the traceback that names it (from the
error record, else stderr), and, per rank, the last collective in its flight recorder,
which shows at a glance which rank fell behind.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from disttrain.comm.liveness import DEAD, RUNNING, STOPPED, process_state
from disttrain.launch import records
from disttrain.launch.ranks import Worker

_TAIL = 15
_CONSEQUENCES = ("PeerFailedError", "WorkerTerminated", "CommTimeoutError",
                 "BarrierTimeoutError", "InitError",
                 "PSPeerFailedError", "PSTimeoutError")  # a parameter server's peers


def exit_code(returncode: int) -> int:
    """A process's status as a shell reports it: 128 + signal for a killed process."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if -returncode == signal.SIGALRM:  # disttrain.launch.hooks.bound_exit's backstop
            return (f"was killed by {name} (its exit after an error took longer than "
                    f"DISTTRAIN_EXIT_TIMEOUT)")
        return f"was killed by {name}"
    if returncode > 128:
        try:
            return f"exited with code {returncode} ({signal.Signals(returncode - 128).name})"
        except ValueError:
            pass
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class Failure:
    """What the launcher knows about a worker that ended with an error."""

    worker: Worker
    record: records.ErrorRecord | None

    @property
    def rank(self) -> int:
        return self.worker.rank

    def is_consequence(self) -> bool:
        """Did it fail because another rank did (a dead peer, a termination)?"""
        return self.record is not None and (
            self.record.kind == "terminated" or self.record.message.startswith(_CONSEQUENCES))

    def sort_key(self) -> tuple[bool, float]:
        seen = self.worker.exited_at or 0.0
        when = self.record.timestamp if self.record and self.record.timestamp else seen
        return (self.is_consequence(), when)


def failures(workers: Sequence[Worker]) -> list[Failure]:
    """Workers that exited with an error, with their error records."""
    out = []
    for worker in workers:
        if worker.returncode not in (None, 0):
            record = records.read_error_record(worker.error_file) if worker.error_file else None
            out.append(Failure(worker, record))
    return out


def first_failure(candidates: Sequence[Failure]) -> Failure:
    return min(candidates, key=Failure.sort_key)


@dataclass(frozen=True)
class Blame:
    """Whom the report names: the first failure itself, or the ranks it blamed."""

    failure: Failure  # the first failure (it names the culprit when it is a consequence)
    ranks: tuple[int, ...]  # the culprit(s)
    how: str  # "was killed by SIGKILL", "was stopped (SIGSTOP or a debugger) ..."
    worker: Worker | None  # the culprit's worker when it runs on this node

    @property
    def named_by_another(self) -> bool:
        return self.ranks != (self.failure.rank,)


def blame(first: Failure, workers: Sequence[Worker]) -> Blame:
    """The culprit of a failure whose first report is ``first`` (see the module doc)."""
    suspects = first.record.suspects if first.record is not None else ()
    own = Blame(first, (first.rank,), describe_exit(first.worker.returncode or 0),
                first.worker)
    if not first.is_consequence() or not suspects or first.rank in suspects:
        return own
    local = [w for w in workers if w.rank in suspects]
    if not local:
        return Blame(first, tuple(suspects), "did not respond (on another node)", None)
    worker = local[0]
    state = DEAD if worker.returncode is not None else process_state(worker.pid)
    how = {STOPPED: "was stopped (SIGSTOP or a debugger) and did not respond",
           RUNNING: "did not respond (alive, but stuck outside the collective its peers "
                    "were in)"}.get(state, "")
    if not how:
        code = worker.poll()
        how = describe_exit(code) if code is not None else "died"
    return Blame(first, tuple(suspects), how, worker)


def notice_for(culprit: Blame, host: str) -> records.FailureNotice:
    failure = culprit.failure
    worker = culprit.worker or failure.worker
    message = failure.record.message if failure.record else ""
    if culprit.named_by_another:
        message = f"named by rank {failure.rank}: {message}"
    return records.FailureNotice(culprit.ranks[0], host, worker.pid, culprit.how, message)


def format_report(culprit: Blame, workers: Sequence[Worker], host: str, run_dir: str) -> str:
    root = culprit.failure
    worker = culprit.worker or root.worker
    others = [w for w in workers if w is not worker]
    stopped = "" if not others else f" and the other {len(others)} local worker(s) were stopped"
    who = (f"rank {culprit.ranks[0]}" if len(culprit.ranks) == 1 else
           f"ranks {list(culprit.ranks)}")
    verb = "it" if len(culprit.ranks) == 1 else "they"
    named = f" (named by rank {root.rank})" if culprit.named_by_another else ""
    lines = [
        f"disttrain launch: {who} failed first; {verb} {culprit.how}{named}{stopped}.",
        f"===== root cause: {who} =====",
    ]
    if culprit.worker is not None:
        lines.append(f"  host       : {host} (local rank {worker.local_rank}, pid {worker.pid})")
    lines.append(f"  exit       : {culprit.how}")
    if culprit.named_by_another:
        accuser = describe_exit(root.worker.returncode or 0)
        lines.append(f"  named by   : rank {root.rank} (which then {accuser})")
    lines += _error_lines(root)
    lines += _other_ranks(others)
    lines += _collectives(workers, run_dir)
    lines.append(f"error records and flight-recorder dumps: {run_dir}")
    return "\n".join(lines)


def _error_lines(root: Failure) -> list[str]:
    """The error (and traceback tail) of the first failure, from its record or stderr."""
    worker = root.worker
    if root.record is not None:
        lines = [f"  error      : {_one_line(root.record.message)}",
                 f"  error file : {worker.error_file}"]
        if root.record.flight_file:
            lines.append(f"  flight rec.: {root.record.flight_file}")
        tail = root.record.traceback.rstrip("\n").splitlines()[-_TAIL:]
        source = "traceback"
    else:
        lines = ["  error file : <none: the process ended before writing one "
                 "(killed by a signal, or it does not call disttrain.init())>"]
        tail = [line.rstrip("\n") for line in worker.stderr_tail][-_TAIL:]
        source = "stderr"
    if tail:
        lines.append(f"  {source} (last {len(tail)} lines):")
        lines += [f"    {line}" for line in tail]
    return lines


def _other_ranks(others: Sequence[Worker]) -> list[str]:
    if not others:
        return []
    lines = ["===== other ranks on this node ====="]
    for worker in others:
        code = worker.returncode
        status = "still running?" if code is None else describe_exit(code)
        record = records.read_error_record(worker.error_file) if worker.error_file else None
        detail = f": {_one_line(record.message)}" if record is not None else ""
        lines.append(f"  rank {worker.rank}: {status}{detail}")
    return lines


def _collectives(workers: Sequence[Worker], run_dir: str) -> list[str]:
    """The last flight-recorder entry of each rank that left a dump."""
    rows = []
    for worker in workers:
        record = records.read_error_record(worker.error_file) if worker.error_file else None
        path = record.flight_file if record and record.flight_file else None
        default = Path(run_dir) / f"flight-rank{worker.rank}.json"
        last = records.last_collective(path or (default if default.exists() else None))
        if last is not None:
            rows.append(f"  rank {worker.rank}: {last.get('op')} #{last.get('seq')} "
                        f"({last.get('algorithm')}, {last.get('nbytes')} bytes) "
                        f"{last.get('state')}")
    return ["===== last collective per rank (flight recorder) =====", *rows] if rows else []


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
