"""launch/ranks.py's function ranks: what each rank said or how it ended, named by rank;
nothing left behind after close()."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from disttrain.launch.ranks import LocalRanks, RankEvent, Signals, Worker, stop_workers


def _act(rank, world_size, store, channel, how):
    channel(("hello", rank, world_size, os.path.basename(store)))
    if how[rank] == "raise":
        raise RuntimeError(f"rank {rank} refuses")
    if how[rank] == "die":
        os._exit(7)
    if how[rank] == "hang":
        time.sleep(60)
    return rank * 10


@pytest.mark.skipif(sys.platform != "linux", reason="forks ranks")
def test_each_rank_is_heard_and_a_death_or_error_is_named_by_rank():
    how = ["return", "raise", "die", "hang"]
    ranks = LocalRanks(_act, [(how,)] * 4, start="fork")
    store_dir = os.path.dirname(ranks.store)
    try:
        events: list[RankEvent] = []
        deadline = time.monotonic() + 60
        # until ranks 0-2 have ended and the hanging rank 3 has reported (under load it may
        # start after the others have ended)
        while (ranks.pending - {3} or not any(e.rank == 3 for e in events)) and (
                time.monotonic() < deadline):
            events += ranks.wait(1.0)
    finally:
        ranks.close()
    by_rank = {r: [(e.kind, e.value) for e in events if e.rank == r] for r in range(4)}
    assert [v for _, v in by_rank[0]] == [("hello", 0, 4, "store"), 0]
    assert [k for k, _ in by_rank[0]] == ["report", "done"]
    assert by_rank[1][1][0] == "error" and "RuntimeError: rank 1 refuses" in by_rank[1][1][1]
    assert by_rank[2][1] == ("died", 7)
    assert [k for k, _ in by_rank[3]] == ["report"]  # still running when closed
    assert not any(proc.is_alive() for proc in ranks.processes)
    assert ranks.exit_code(3) == -signal.SIGTERM
    assert not os.path.exists(store_dir)


def test_an_unknown_start_method_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="start must be 'forkserver', 'spawn' or 'fork'"):
        LocalRanks(_act, [()], start="vfork")


def test_stopping_never_signals_a_reaped_worker_s_reused_pid():
    """A worker reaped long ago: its pid may belong to another process now, leading a group
    of its own (root reaches any). Stopping the job must leave that process alone."""
    worker = Worker(0, 0, [sys.executable, "-c", "pass"], dict(os.environ))
    worker.wait()  # exited and reaped: its pid is free
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        worker.popen.pid = stranger.pid  # the kernel gave the pid to someone else
        stop_workers([worker], signal.SIGTERM, 0.2, Signals())
        time.sleep(0.1)
        assert stranger.poll() is None, "the stranger's group was signalled"
    finally:
        stranger.kill()
        stranger.wait()


def test_stopping_still_reaches_what_a_reaped_worker_left_in_its_group():
    worker = Worker(0, 0, ["sh", "-c", "sleep 60 & echo $!"], dict(os.environ))
    left = int(worker.popen.stdout.readline())  # in the worker's group, outliving it
    worker.wait()
    stop_workers([worker], signal.SIGTERM, 0.2, Signals())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{left}") \
            and open(f"/proc/{left}/stat").read().split()[2] != "Z":
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{left}") or \
        open(f"/proc/{left}/stat").read().split()[2] == "Z"
