"""Gloo's I/O threads go to SCHED_IDLE, SCHED_BATCH or stay, as DISTTRAIN_GLOO_IO_THREADS says."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from disttrain.comm.transports import gloo_threads

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux") or
                                not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling")


@contextmanager
def named_thread(name: str) -> Iterator[int]:
    """A thread whose kernel name is ``name`` (as Gloo names its loop), alive in the block."""
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def body() -> None:
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
        tid.append(threading.get_native_id())
        ready.set()
        done.wait(30)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield tid[0]
    finally:
        done.set()
        thread.join(30)


@linux_only
@pytest.mark.parametrize("policy,expected", [("idle", "SCHED_IDLE"), ("batch", "SCHED_BATCH")])
def test_only_threads_named_like_gloos_loop_change_and_only_once(policy: str,
                                                                  expected: str) -> None:
    with named_thread("gloo_tcp_loop") as loop, named_thread("not_gloo") as other:
        assert loop in gloo_threads.io_threads() and other not in gloo_threads.io_threads()
        assert gloo_threads.tune_io_threads(policy) == [loop]
        assert os.sched_getscheduler(loop) == getattr(os, expected)
        assert os.sched_getscheduler(other) == os.SCHED_OTHER
        assert gloo_threads.tune_io_threads(policy) == []  # already there: nothing to do


@linux_only
def test_normal_leaves_the_loop_thread_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gloo_threads.ENV, "normal")
    with named_thread("gloo_tcp_loop") as loop:
        assert gloo_threads.tune_io_threads() == []
        assert os.sched_getscheduler(loop) == os.SCHED_OTHER


def test_the_environment_chooses_and_a_typo_names_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gloo_threads.ENV, raising=False)
    assert gloo_threads.policy_from_env() == "idle"
    monkeypatch.setenv(gloo_threads.ENV, " Batch ")
    assert gloo_threads.policy_from_env() == "batch"
    monkeypatch.setenv(gloo_threads.ENV, "idel")
    with pytest.raises(ValueError, match=r"DISTTRAIN_GLOO_IO_THREADS='idel'.*idle, batch, normal"):
        gloo_threads.policy_from_env()
    with pytest.raises(ValueError, match="policy='fifo'"):
        gloo_threads.tune_io_threads("fifo")


def io_thread_policies(comm: Any) -> list[int]:
    return [os.sched_getscheduler(t) for t in gloo_threads.io_threads()]


@linux_only
def test_a_rank_with_a_communicator_has_its_gloo_io_threads_idle(
        pools: Callable[[int], Any]) -> None:
    """The pool's ranks made a Communicator over Gloo: Gloo's own loop threads (this torch's
    names them ``gloo_tcp_loop``) must have been found and moved to SCHED_IDLE."""
    for rank, policies in enumerate(pools(2).run(io_thread_policies)):
        assert policies, f"rank {rank}: no thread named gloo_tcp_loop (did Gloo rename it?)"
        assert set(policies) == {os.SCHED_IDLE}, f"rank {rank}: {policies}"
