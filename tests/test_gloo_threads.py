"""Gloo's I/O threads: SCHED_IDLE for collectives, normal for point-to-point, or as set."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from disttrain.comm import CommConfig, Communicator
from disttrain.comm.transports import gloo_threads
from disttrain.parallel.ddp import DataParallel
from tests.dist import init_gloo, run_fresh
from tests.test_comm_units import _OneRank

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
def test_only_threads_named_like_gloos_loop_change_and_only_once(
        monkeypatch: pytest.MonkeyPatch, policy: str, expected: str) -> None:
    monkeypatch.setenv(gloo_threads.ENV, policy)
    with named_thread("gloo_tcp_loop") as loop, named_thread("not_gloo") as other:
        assert loop in gloo_threads.io_threads() and other not in gloo_threads.io_threads()
        changed = gloo_threads.tune_io_threads()  # (and any Gloo group of this process's)
        assert loop in changed and other not in changed
        assert os.sched_getscheduler(loop) == getattr(os, expected)
        assert os.sched_getscheduler(other) == os.SCHED_OTHER
        assert loop not in gloo_threads.tune_io_threads("p2p")  # explicit: workloads don't move it
        assert os.sched_getscheduler(loop) == getattr(os, expected)


@linux_only
def test_auto_waits_for_a_workload_and_leaves_idle_for_good_once_p2p_is_seen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gloo_threads.ENV, raising=False)
    monkeypatch.setattr(gloo_threads, "_chosen", None)
    with named_thread("gloo_tcp_loop") as loop:
        assert gloo_threads.tune_io_threads() == []  # a transport made: nothing to go by yet
        assert os.sched_getscheduler(loop) == os.SCHED_OTHER
        assert loop in gloo_threads.tune_io_threads("collectives")
        assert os.sched_getscheduler(loop) == os.SCHED_IDLE
        assert gloo_threads.resolve(None) == "idle"  # a later group's threads follow
        gloo_threads.tune_io_threads("p2p")
        assert gloo_threads.resolve("collectives") == "normal"  # p2p wins for good
        if os.geteuid() == 0:  # leaving SCHED_IDLE needs the right to raise priority
            assert os.sched_getscheduler(loop) == os.SCHED_OTHER


@linux_only
def test_normal_leaves_the_loop_thread_as_gloo_starts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gloo_threads.ENV, "normal")
    with named_thread("gloo_tcp_loop") as loop:
        assert loop not in gloo_threads.tune_io_threads("collectives")
        assert os.sched_getscheduler(loop) == os.SCHED_OTHER


def test_the_environment_chooses_and_a_typo_names_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gloo_threads.ENV, raising=False)
    assert gloo_threads.policy_from_env() == "auto"
    monkeypatch.setenv(gloo_threads.ENV, " Batch ")
    assert gloo_threads.policy_from_env() == "batch"
    assert gloo_threads.resolve("p2p") == "batch"
    monkeypatch.setenv(gloo_threads.ENV, "idel")
    with pytest.raises(ValueError, match=r"DISTTRAIN_GLOO_IO_THREADS='idel'.*auto, idle, batch"):
        gloo_threads.policy_from_env()
    monkeypatch.delenv(gloo_threads.ENV)
    with pytest.raises(ValueError, match="workload='ring'"):
        gloo_threads.resolve("ring")


def workload_policies(rank: int, world_size: int, store: str) -> list[int]:
    """On fresh ranks: the loop threads' policy after the communicator, after DDP, after p2p."""
    comm = init_gloo(rank, world_size, store)
    seen = [sorted(set(map(os.sched_getscheduler, gloo_threads.io_threads())))]
    DataParallel(torch.nn.Linear(4, 2), comm)
    seen.append(sorted(set(map(os.sched_getscheduler, gloo_threads.io_threads()))))
    x = torch.zeros(3)
    peer = 1 - comm.rank
    sent, got = comm.isend(x, peer), comm.irecv(torch.zeros(3), peer)
    sent.wait()
    got.wait()
    seen.append(sorted(set(map(os.sched_getscheduler, gloo_threads.io_threads()))))
    comm.close()
    return seen


@linux_only
def test_ddp_makes_gloos_threads_idle_and_a_send_makes_them_normal_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Real Gloo ranks: the threads this torch names ``gloo_tcp_loop`` exist, start normal,
    go idle when DataParallel is built and normal again at the first point-to-point send."""
    monkeypatch.delenv(gloo_threads.ENV, raising=False)
    back = os.SCHED_OTHER if os.geteuid() == 0 else os.SCHED_IDLE
    for rank, seen in enumerate(run_fresh(workload_policies, 2)):
        assert seen[0], f"rank {rank}: no thread named gloo_tcp_loop (did Gloo rename it?)"
        assert seen == [[os.SCHED_OTHER], [os.SCHED_IDLE], [back]], f"rank {rank}: {seen}"


class _Told(_OneRank):
    """A one-rank transport that records what it was told about the workload."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[str] = []

    def tune_io(self, workload: str) -> None:
        self.told.append(workload)


def test_the_communicator_passes_a_known_workload_on_and_names_the_choices() -> None:
    transport = _Told()
    comm = Communicator(transport, CommConfig())
    comm.expect_workload("collectives")
    with pytest.raises(ValueError, match=r"workload='pipeline'.*collectives, p2p"):
        comm.expect_workload("pipeline")
    assert transport.told == ["collectives"]
    comm.close()
