"""Benchmark ranks forked from the preloading server: fresh processes with today's environment."""

from __future__ import annotations

import os

import pytest

from disttrain.bench.ranks import RankGroup
from disttrain.launch import ranks as launch_ranks


def _report_environment(comm, emit):
    import torch

    emit((os.environ.get("DISTTRAIN_FORKSERVER_MARK"), torch.get_num_threads(), os.getpid()))


def test_ranks_take_the_environment_of_the_moment(monkeypatch):
    seen = []
    for mark in ("one", "two"):  # the second group forks from the server the first started
        monkeypatch.setenv("DISTTRAIN_FORKSERVER_MARK", mark)
        with RankGroup(2, _report_environment, (), transport="torch", timeout_s=30) as group:
            (reports,) = list(group.reports())
        assert [r[:2] for r in reports] == [(mark, 1)] * 2
        seen += [r[2] for r in reports]
    assert len(set(seen)) == 4 and os.getpid() not in seen


def test_a_preload_list_set_before_is_kept(monkeypatch):
    from multiprocessing import forkserver as mp_forkserver

    server = mp_forkserver.ForkServer()  # a stand-in for the process-wide one
    server.set_forkserver_preload(["json"])
    monkeypatch.setattr(mp_forkserver, "_forkserver", server)
    monkeypatch.setattr(mp_forkserver, "set_forkserver_preload",
                        server.set_forkserver_preload)
    launch_ranks.rank_context(("torch",))
    assert server._preload_modules == ["json", "torch"]


def test_adopt_environment_replaces_the_whole_environment(monkeypatch):
    monkeypatch.setenv("DISTTRAIN_FORKSERVER_STALE", "1")
    wanted = {k: v for k, v in os.environ.items() if k != "DISTTRAIN_FORKSERVER_STALE"}
    wanted["DISTTRAIN_FORKSERVER_NEW"] = "2"
    before = dict(os.environ)
    try:
        launch_ranks.adopt_environment(wanted)
        assert dict(os.environ) == wanted
    finally:
        os.environ.clear()
        os.environ.update(before)


def test_the_start_method_can_be_spawn_and_a_typo_is_named(monkeypatch):
    monkeypatch.setenv(launch_ranks.START_VAR, "spawn")
    assert launch_ranks.rank_context().get_start_method() == "spawn"
    monkeypatch.setenv(launch_ranks.START_VAR, "fork-server")
    with pytest.raises(ValueError, match="DISTTRAIN_RANK_START must be 'forkserver' or 'spawn'"):
        launch_ranks.rank_context()
