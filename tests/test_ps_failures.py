"""A killed server or worker is reported by role and rank within the timeout; nobody hangs.
In async and ssp mode the servers and the other workers outlive a killed worker.

The victim rank runs its role in a subprocess that SIGKILLs itself mid-training (the
harness's own processes are daemons, which may not have multiprocessing children, and a
rank that dies under run_fresh would make it stop the survivors before they report). The
survivors return what they raised, and when.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

from disttrain.launch.config import LaunchConfig
from disttrain.parallel.checkpoint_files import verify
from tests.dist import run_fresh
from tests.launch_scripts.harness import SCRIPTS, clean_env, run_cli
from tests.ps_cases import catching, make_mlp, mlp_batch, sgd

COMM_TIMEOUT_S = 60.0  # Gloo's own limit: the parameter server's deadlines fire long before
PS_TIMEOUT_S = 3.0
# What a failure report's delay must stay under: the PS deadline plus a margin of several
# seconds for a loaded 2-core machine (the ranks' interpreters, the kill, the polling), far
# below Gloo's own 60 s, which is what a report that missed the PS deadline would take
REPORT_WITHIN_S = PS_TIMEOUT_S + 15
KILL_AT = 2  # the victim dies at this clock (worker) or parameter version (server)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def play(comm: Any, kill: bool, mode: str = "sync", servers: int = 1, steps: int = 40) -> Any:
    """Serve, or train for up to ``steps`` steps; the victim SIGKILLs itself at KILL_AT."""
    import torch.nn.functional as F

    from disttrain.parallel.parameter_server import (
        PSConfig,
        PSWorker,
        assign_roles,
        run_parameter_server,
    )

    roles = assign_roles(comm.world_size, servers)
    config = PSConfig(mode=mode, staleness=1, timeout_s=PS_TIMEOUT_S)

    def die(at: int) -> None:
        if kill and at == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    if roles.role(comm.rank).kind == "server":
        return run_parameter_server(comm, roles, make_mlp(), sgd, config, on_update=die)
    model = make_mlp()
    ps = PSWorker(comm, model, roles, config)
    for _ in range(steps):
        clock = ps.clock
        die(clock)
        ps.pull()
        x, y = mlp_batch(ps.clock, 4)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        # the survivor reaches the gate after the victim died, so in sync mode the server
        # holds it there when it stops, and tells it
        time.sleep(1.5 if clock == KILL_AT and mode == "sync" else 0.1)
        ps.push()
    return ps.close()


def connect(rank: int, world_size: int, store: str) -> Any:
    """Gloo and a communicator with a patient timeout (the victim's interpreter may start
    slowly on a busy machine); failures are caught by the parameter server's 3 s deadlines."""
    import torch
    import torch.distributed as dist

    from disttrain.comm import CommConfig, Communicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COMM_TIMEOUT_S))
    return Communicator.from_torch(config=CommConfig(timeout_s=COMM_TIMEOUT_S))


def victim_main(rank: int, world_size: int, store: str, *args: Any) -> None:
    play(connect(rank, world_size, store), True, *args)


def rank_main(rank: int, world_size: int, store: str, victim: int,
              *args: Any) -> dict[str, Any]:
    """``args``: play's mode, servers and steps."""
    if rank != victim:
        return catching(play, connect(rank, world_size, store), False, *args)
    code = (f"from tests.test_ps_failures import victim_main; "
            f"victim_main({rank}, {world_size}, {store!r}, *{args!r})")
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=log)
        try:
            deadline = time.monotonic() + 90
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            died_at = time.time()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        return {"exit": proc.returncode, "died_at": died_at, "stderr": log.read()[-3000:]}


def _check(results: list[dict[str, Any]], victim: int, expect: dict[int, str]) -> None:
    assert results[victim]["exit"] == -signal.SIGKILL, results[victim]["stderr"]
    for rank, name in expect.items():
        outcome = results[rank]
        assert outcome["error"] in ("PSPeerFailedError", "PSTimeoutError"), outcome
        assert name in outcome["message"], outcome["message"]
        # a deadline runs from the last message, before the death: reported by the PS's
        # deadline, not Gloo's
        assert outcome["at"] - results[victim]["died_at"] < REPORT_WITHIN_S


def test_killed_worker_is_reported_by_the_server_and_the_other_worker() -> None:
    results = run_fresh(rank_main, 3, 1, timeout_s=100)  # workers: ranks 0, 1; server: 2
    # the server names the dead worker, and tells the worker it holds at the sync gate
    _check(results, 1, {2: "worker 1 (rank 1)", 0: "worker 1 (rank 1)"})
    assert results[0]["message"].startswith("server 0 (rank 2) stopped serving because")


def test_killed_server_is_reported_by_every_worker() -> None:
    results = run_fresh(rank_main, 3, 2, timeout_s=100)
    _check(results, 2, {0: "server 0 (rank 2)", 1: "server 0 (rank 2)"})


@pytest.mark.parametrize(("mode", "servers"), [("async", 2), ("ssp", 1)])
def test_async_and_ssp_outlive_a_killed_worker(mode: str, servers: int) -> None:
    # 3 workers; worker 1 dies before its clock 2: the servers drop it (in ssp its clock
    # leaves the bound, or the gate would hold the others for ever) and the others finish
    steps = 8
    results = run_fresh(rank_main, 3 + servers, 1, mode, servers, steps, timeout_s=100)
    assert results[1]["exit"] == -signal.SIGKILL, results[1]["stderr"]
    for rank in (0, 2):
        outcome = results[rank]
        assert outcome["error"] is None, outcome
        report = outcome["result"]
        assert report.steps == steps and report.lost_workers == (1,), report
    for rank in range(3, 3 + servers):
        report = results[rank]["result"]
        assert sorted(report.lost) == [1], report.lost
        assert "worker 1 (rank 1)" in report.lost[1] and "at clock 2" in report.lost[1]
        # every push applied on arrival: the survivors' and the victim's first two
        assert report.version == 2 * steps + KILL_AT == report.histogram.total


# ------------------------------------------------------------------ disttrain run / launch
RUN = ("--model", "mlp", "--steps", "10", "--global-batch", "30", "--eval-every", "4",
       "--log-every", "0", "--no-progress", "--comm-timeout", "20")


def test_run_ps_async_finishes_without_a_killed_worker_and_reports_it(tmp_path: Any) -> None:
    # worker 1 dies in its 4th training step; async evaluations mid-run are each worker's
    # own, so nothing waits for it; the survivors' final evaluation and result are one
    out = tmp_path / "result.json"
    proc = run_cli("run", "--strategy", "ps-async", "-n", "3", "--servers", "1", *RUN,
                   "--model", "tests.launch_scripts.ps_victim:mlp", "--json", str(out),
                   env=clean_env(PS_KILL="1:4"))
    assert proc.returncode == 0, proc.stderr
    assert "lost worker 1 (rank 1) at clock 3" in proc.stderr
    assert "rank 1 died" in proc.stderr and "went on without it" in proc.stderr
    assert "lost_workers=[1]" in proc.stdout
    result = json.loads(out.read_text())
    assert result["rank"] == 0 and result["steps"] == 10 and result["accuracy"] > 0
    assert result["extras"]["lost_workers"] == [1] and result["extras"]["workers"] == 3


def test_run_ps_sync_fails_at_a_killed_worker_naming_it() -> None:
    proc = run_cli("run", "--strategy", "ps-sync", "-n", "3", "--servers", "1", *RUN,
                   "--model", "tests.launch_scripts.ps_victim:mlp", env=clean_env(PS_KILL="1:4"))
    assert proc.returncode == 1, proc.stderr
    assert "disttrain run: rank 1 died" in proc.stderr


def test_launch_goes_on_without_worker_0_when_told(tmp_path: Any) -> None:
    # rank 0 (which reports by default) dies after step 3; 2 servers agree on the loss and
    # the first survivor, worker 1, prints the result
    out, ckpt = tmp_path / "result.json", tmp_path / "ckpt"
    proc = run_cli("launch", "-n", "3", "--servers", "2", "--tolerate-worker-loss",
                   str(SCRIPTS / "fault_run.py"), "--strategy", "ps-async", *RUN,
                   "--json", str(out), "--checkpoint-dir", str(ckpt),
                   env=clean_env(FAULT_KILL="0:3"))
    assert proc.returncode == 0, proc.stderr
    assert ("disttrain launch: worker rank 0 was killed by SIGKILL; the job goes on without "
            "it (--tolerate-worker-loss)") in proc.stderr
    for server in (0, 1):
        assert f"server {server} (rank {3 + server}): lost worker 0 (rank 0)" in proc.stderr
    assert "[rank 1] lost_workers=[0]" in proc.stdout
    assert "[rank 0] result" not in proc.stdout and "[rank 2] result" not in proc.stdout
    result = json.loads(out.read_text())
    assert result["rank"] == 1 and result["steps"] == 10 and result["world_size"] == 5
    # the survivors' end checkpoint: sealed, the run file from worker 1, no file of rank 0
    step = ckpt / "step-00000010"
    verify(str(step))
    assert (ckpt / "latest").read_text() == step.name
    assert sorted(p.name for p in step.iterdir() if p.name.startswith(("ps-", "rank-"))) == [
        "ps-run.pt", "ps-server-000", "ps-server-001", "rank-00001.pt", "rank-00002.pt",
        "rank-00003.pt", "rank-00004.pt"]


def test_tolerating_worker_loss_needs_to_know_the_workers() -> None:
    with pytest.raises(ValueError, match="--tolerate-worker-loss needs --servers S"):
        LaunchConfig(str(SCRIPTS / "fault_run.py"), nproc_per_node=2, tolerate_worker_loss=True)


def test_launch_names_a_killed_server_even_when_worker_losses_are_tolerated() -> None:
    # server 0 (rank 2) dies at version 5: the workers cannot go on without its keys, and
    # the launcher blames it, not a worker that reported it first. A worker names it when it
    # next talks to it; the launcher may stop the other worker before it does (an async
    # worker between exchanges with server 1 on a loaded machine), so one naming it is enough
    proc = run_cli("launch", "-n", "2", "--servers", "2", "--tolerate-worker-loss",
                   str(SCRIPTS / "ps_server_fault.py"), "--strategy", "ps-async", *RUN,
                   env=clean_env(PS_SERVER_KILL="2:5"))
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "rank 2 failed first; it was killed by SIGKILL" in proc.stderr
    assert re.search(r"\[rank [01]\].*server 0 \(rank 2\) failed", proc.stderr), proc.stderr
