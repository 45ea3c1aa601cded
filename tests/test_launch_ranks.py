"""launch/ranks.py's function ranks: what each rank said or how it ended, named by rank;
nothing left behind after close()."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from disttrain.launch.ranks import LocalRanks, RankEvent


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
