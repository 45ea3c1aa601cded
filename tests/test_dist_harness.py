"""The test harness itself: ranks forked from the preloading server behave as spawned ones."""

from __future__ import annotations

import os
from typing import Any

from tests.dist import run_fresh


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
