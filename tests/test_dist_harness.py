"""The test harness itself: ranks forked from the preloading server behave as spawned ones."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from tests.dist import DistPool, run_fresh


def _probe(rank: int, world_size: int, store: str) -> tuple[Any, ...]:
    import torch

    return os.environ.get("DISTTRAIN_HARNESS_MARK"), torch.get_num_threads(), os.getpid()


def test_ranks_see_the_environment_of_the_moment_and_one_thread(monkeypatch):
    # the fork server keeps the environment it started with: a rank must get today's
    monkeypatch.setenv("DISTTRAIN_HARNESS_MARK", "first")
    first = run_fresh(_probe, 2)
    monkeypatch.setenv("DISTTRAIN_HARNESS_MARK", "second")
    second = run_fresh(_probe, 2)
    assert [r[:2] for r in first] == [("first", 1)] * 2
    assert [r[:2] for r in second] == [("second", 1)] * 2
    pids = {r[2] for r in first + second}
    assert len(pids) == 4 and os.getpid() not in pids  # a fresh process per rank and call


def _rank_and_pid(comm: Any) -> tuple[int, int]:
    return comm.rank, os.getpid()


def test_a_pool_whose_rank_died_between_tests_starts_afresh():
    """Before, a pool rank killed between two tests (by a signal, the OOM killer) made
    every later test on that pool fail with BrokenPipeError (244 failures in one run)."""
    pool = DistPool(2)
    try:
        first = pool.run(_rank_and_pid)
        os.kill(first[1][1], signal.SIGKILL)
        pool._procs[1].join(30)
        with pytest.warns(UserWarning, match=r"rank\(s\) \[1\] died between tests"):
            second = pool.run(_rank_and_pid)
        assert [r for r, _ in second] == [0, 1]
        assert not {p for _, p in first} & {p for _, p in second}  # a fresh pool
        assert pool.run(_rank_and_pid) == second  # and it stays up
    finally:
        pool.close()
