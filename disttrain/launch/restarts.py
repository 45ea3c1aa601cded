"""``disttrain launch --max-restarts N``: run the job again after a failure, as torchrun does.

    run every local worker ──► all exit 0 ────────────────────────────► exit 0
          ▲                └─► a worker fails: all stopped, report ──┐
          └── restart k of N (TORCHELASTIC_RESTART_COUNT=k) ◄── k ≤ N ┘
                                                   k > N: give up with the last failure's code

Each attempt is one call of :func:`~disttrain.launch.launcher.launch`: a fresh rendezvous
store, fresh workers, the whole job at once (torchrun's "restart all workers" policy). The
workers see torchrun's ``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_MAX_RESTARTS``;
``disttrain run`` resumes from ``--checkpoint-dir`` when the count is above 0. A signal to
the launcher (Ctrl-C) ends the job without a restart. On several nodes each node's launcher
restarts its own workers: give every node the same ``--max-restarts``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from disttrain.launch import records
from disttrain.launch.config import LaunchConfig
from disttrain.launch.launcher import launch
from disttrain.launch.summary import Blame, describe_exit


def launch_with_restarts(config: LaunchConfig) -> int:
    """Run the job, restarting it after a failure up to ``config.max_restarts`` times;
    return the exit code of the last attempt."""
    for attempt in range(config.max_restarts + 1):
        failed: list[Blame] = []
        code = launch(_attempt_config(config, attempt), attempt, failed.append)
        if not failed or config.max_restarts == 0:  # done, stopped by a signal, or no restarts
            return code
        what = describe_failure(failed[0])
        if attempt == config.max_restarts:
            _say(f"giving up after {attempt} restart(s); the last failure: {what} "
                 f"(exit code {code})")
            return code
        _say(f"{what}; restarting all {config.local_processes} local worker(s) "
             f"(restart {attempt + 1} of {config.max_restarts})")
    raise AssertionError("unreachable: the last attempt returns")


def _attempt_config(config: LaunchConfig, attempt: int) -> LaunchConfig:
    """A given ``--run-dir`` gets a subdirectory per restart, so no attempt reads another's
    error records or failure notice (a temporary run directory is new each time anyway)."""
    if attempt == 0 or config.run_dir is None:
        return config
    return dataclasses.replace(config, run_dir=os.path.join(config.run_dir, f"restart-{attempt}"))


def describe_failure(blame: Blame) -> str:
    """``rank 1 was killed by SIGKILL`` / ``rank 2 exited with code 1 (ValueError: …)`` /
    ``rank 1 was stopped (…)``: the culprit, when a survivor's record names it."""
    if blame.named_by_another:
        word = "rank" if len(blame.ranks) == 1 else "ranks"
        return f"{word} {', '.join(map(str, blame.ranks))} {blame.how}"
    worker = blame.failure.worker
    assert worker.returncode is not None
    record = records.read_error_record(worker.error_file) if worker.error_file else None
    message = " ".join(record.message.split())[:200] if record is not None else ""
    return f"rank {worker.rank} {describe_exit(worker.returncode)}" + (
        f" ({message})" if message else "")


def _say(line: str) -> None:
    print(f"disttrain launch: {line}", file=sys.stderr, flush=True)
