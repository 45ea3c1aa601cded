"""monitored_barrier on real Gloo ranks: passes when all arrive, and otherwise every rank
raises the same error naming the ranks that were late or dead."""

from __future__ import annotations

import os
import time

import pytest
import torch

from disttrain.comm.monitored_barrier import BarrierTimeoutError, monitored_barrier
from tests.dist import (
    adopt_environment,
    environment,
    init_gloo,
    rank_context,
    wait_until_posts_refused,
)

TIMEOUT_S = 3.0  # generous: ranks of a loaded machine must not look late by accident


def _barrier_then_sum(comm):
    monitored_barrier(comm, timeout_s=TIMEOUT_S)
    value = torch.tensor([float(comm.rank + 1)])
    comm.all_reduce(value)  # the communicator is still healthy afterwards
    return value.item()


def _one_rank_late(comm, late):
    if comm.rank == late:
        time.sleep(TIMEOUT_S + 2)
    try:
        monitored_barrier(comm, timeout_s=TIMEOUT_S)
    except BarrierTimeoutError as exc:
        return exc.missing, str(exc)
    return None


def test_everyone_arrives(pools):
    assert pools(3).run(_barrier_then_sum) == [6.0, 6.0, 6.0]


def test_late_rank_is_named_on_every_rank_including_itself(pools):
    results = pools(3).run(_one_rank_late, 2)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} passed a barrier that rank 2 missed"
        missing, message = result
        assert missing == (2,)
        assert f"on rank {rank}: rank 2 did not arrive within {TIMEOUT_S:g}s" in message
    # nothing stale is left behind: the next barrier and collective work normally
    assert pools(3).run(_barrier_then_sum) == [6.0, 6.0, 6.0]


def _dead_rank(rank, store, answers, env, refused_first):
    adopt_environment(env)
    comm = init_gloo(rank, 2, store, comm_timeout_s=30)
    comm.barrier()
    if rank == 1:
        os._exit(0)  # dies without a word
    if refused_first:
        wait_until_posts_refused(1)
    try:
        monitored_barrier(comm, timeout_s=TIMEOUT_S)
        answers.put(None)
    except BarrierTimeoutError as exc:
        answers.put((exc.missing, str(exc)))
    except Exception as exc:  # the test reports it
        answers.put(((), f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("refused_first", [False, True], ids=["at-once", "post-refused"])
def test_dead_rank_is_named(tmp_path, refused_first):
    """Rank 0 enters the barrier right after rank 1 died, or once Gloo refuses to even post
    a receive from it (which must count as a broken link, not escape as an error)."""
    ctx = rank_context()
    answers = ctx.Queue()
    procs = [ctx.Process(target=_dead_rank,
                         args=(r, str(tmp_path / "store"), answers, environment(),
                               refused_first),
                         daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        result = answers.get(timeout=120)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    assert result is not None, "rank 0 passed a barrier that rank 1 never reached"
    missing, message = result
    assert missing == (1,) and "rank 1" in message, message
