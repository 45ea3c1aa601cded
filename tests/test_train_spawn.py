"""run_local's collection of results: the rank named is the root cause, not a survivor that
reported its broken connection first."""

from __future__ import annotations

import time

import pytest

from disttrain.train.spawn import RankFailedError, _collect, root_cause
from tests.dist import rank_context

SURVIVOR = ("Traceback (most recent call last):\n  ...\nRuntimeError: [../third_party/gloo/"
            "gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234\n")
CULPRIT = "Traceback (most recent call last):\n  ...\nRuntimeError: rank 1 refuses\n"


def _report(conn, delay_s, message):
    time.sleep(delay_s)
    conn.send(("error", message))


def _ranks(plan):
    ctx = rank_context()  # not a bare fork of this multi-threaded test process
    procs, conns = [], []
    for delay_s, message in plan:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_report, args=(child, delay_s, message), daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    return procs, conns


@pytest.mark.parametrize("survivor_delay, culprit_delay", [(0.0, 0.4), (0.4, 0.0)])
def test_the_root_cause_is_named_whichever_rank_reports_first(survivor_delay, culprit_delay):
    procs, conns = _ranks([(survivor_delay, SURVIVOR), (culprit_delay, CULPRIT)])
    try:
        with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: rank 1 refuses"):
            _collect(procs, conns, timeout_s=30)
    finally:
        for proc in procs:
            proc.join(5)


def test_when_every_failure_is_a_consequence_the_first_seen_is_named():
    first = RankFailedError(2, "failed", "PeerFailedError: rank 0 failed")
    second = RankFailedError(0, "failed", "CommTimeoutError: all_reduce #3 timed out")
    assert root_cause([first, second]) is first
    culprit = RankFailedError(1, "died", "process exited with code 7")
    assert root_cause([first, culprit, second]) is culprit


def test_a_parameter_server_peer_error_is_a_consequence_too():
    from disttrain.launch.records import ErrorRecord
    from disttrain.launch.summary import Failure

    waited = RankFailedError(0, "failed", "PSTimeoutError: server 0 (rank 2) did not answer")
    culprit = RankFailedError(2, "died", "process exited with code -9")
    assert root_cause([waited, culprit]) is culprit
    for message in ("PSPeerFailedError: server 0 (rank 2) failed", "PSTimeoutError: server 0"):
        record = ErrorRecord(message, "", 1.0)
        assert Failure(None, record).is_consequence(), message  # type: ignore[arg-type]
    assert not Failure(None, ErrorRecord("PSError: mine", "", 1.0)).is_consequence()  # type: ignore[arg-type]
