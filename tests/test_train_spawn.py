"""run_local's collection of results: the rank named is the root cause, not a survivor that
reported its broken connection first."""

from __future__ import annotations

import time

import pytest

from disttrain.launch.ranks import LocalRanks
from disttrain.train.spawn import RankFailedError, _collect, root_cause

SURVIVOR = ("Traceback (most recent call last):\n  ...\nRuntimeError: [../third_party/gloo/"
            "gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234\n")
CULPRIT = "Traceback (most recent call last):\n  ...\nRuntimeError: rank 1 refuses\n"


def _report(rank, world_size, store, channel, delays_messages):
    delay_s, message = delays_messages[rank]
    time.sleep(delay_s)
    channel(("error", message))


@pytest.mark.parametrize("survivor_delay, culprit_delay", [(0.0, 0.4), (0.4, 0.0)])
def test_the_root_cause_is_named_whichever_rank_reports_first(survivor_delay, culprit_delay):
    plan = [(survivor_delay, SURVIVOR), (culprit_delay, CULPRIT)]
    ranks = LocalRanks(_report, [(plan,)] * 2)
    try:
        with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: rank 1 refuses"):
            _collect(ranks, timeout_s=30)
    finally:
        ranks.close(grace_s=5)


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
