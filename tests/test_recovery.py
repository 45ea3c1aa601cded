"""Automatic recovery: ``disttrain launch --max-restarts N`` restarts the whole job after a
failure, and ``disttrain run`` resumes from its latest complete checkpoint, ending with the
parameters of an uninterrupted run; ZeRO resumes on fewer ranks."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from disttrain.launch.config import LaunchConfig
from disttrain.launch.restarts import launch_with_restarts
from disttrain.parallel import zero
from disttrain.train import TrainConfig
from tests.launch_scripts.harness import SCRIPTS, clean_env, json_lines, run_cli
from tests.test_train_loop import rank_train

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------------ the restart loop
def restarts(capfd: Any, mode: str, max_restarts: int, run_dir: Path) -> tuple[int, str, str]:
    code = launch_with_restarts(LaunchConfig(str(SCRIPTS / "restart.py"), args=(mode,),
                                             nproc_per_node=2, max_restarts=max_restarts,
                                             run_dir=str(run_dir), grace_s=2))
    out, err = capfd.readouterr()
    return code, out, err


def test_a_failed_job_is_restarted_whole(capfd, tmp_path):
    code, out, err = restarts(capfd, "fail-once", 2, tmp_path / "run")
    assert code == 0, err
    assert ("disttrain launch: rank 1 exited with code 7; restarting all 2 local worker(s) "
            "(restart 1 of 2)") in err
    assert "rank 1 failed first; it exited with code 7" in err  # the attempt's own report
    seen = [json.loads(line.split("] ", 1)[1]) for line in out.splitlines() if "count" in line]
    assert sorted((s["count"], s["max"]) for s in seen) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert len({s["port"] for s in seen}) == 2  # a fresh rendezvous store per attempt
    assert (tmp_path / "run" / "restart-1").is_dir()  # records of each attempt apart


def test_giving_up_reports_the_last_failure_and_its_code(capfd, tmp_path):
    code, _, err = restarts(capfd, "fail-always", 1, tmp_path / "run")
    assert code == 7, err
    assert err.count("restarting all 2 local worker(s)") == 1
    assert err.strip().splitlines()[-1] == (
        "disttrain launch: giving up after 1 restart(s); the last failure: rank 1 exited "
        "with code 7 (exit code 7)")


def test_without_max_restarts_nothing_restarts(capfd, tmp_path):
    code, out, err = restarts(capfd, "fail-once", 0, tmp_path / "run")
    assert code == 7 and "restarting" not in err and "giving up" not in err
    assert {s["count"] for s in json_lines(out).values()} == {0}


def test_max_restarts_must_be_a_count():
    with pytest.raises(ValueError, match="--max-restarts must be a whole number ≥ 0"):
        LaunchConfig(str(SCRIPTS / "restart.py"), max_restarts=-1)


# ------------------------------------------------------------------ training resumes
CONFIG = TrainConfig(model="mlp", global_batch=48, steps=6, checkpoint_every=2, eval_every=0,
                     log_every=0, progress=False)
RUN_ARGS = ["--model", "mlp", "--global-batch", "48", "--steps", "6", "--checkpoint-every",
            "2", "--eval-every", "0", "--log-every", "0", "--no-progress"]


def launch_run(nproc: int, strategy: str, directory: Path, launch_args: tuple[str, ...] = (),
               run_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Any:
    return run_cli("launch", *launch_args, "-n", str(nproc), str(SCRIPTS / "fault_run.py"),
                   "--strategy", strategy, *RUN_ARGS, "--checkpoint-dir", str(directory),
                   "--json", str(directory / "result.json"), *run_args,
                   env=clean_env(**(env or {})))


def test_ddp_killed_mid_run_restarts_and_ends_like_an_uninterrupted_run(pools, tmp_path):
    """Rank 1 is SIGKILLed after step 4, before step 4's checkpoint (ranks 0 and 2 are then
    inside it): the restart resumes from step 2 and ends with the uninterrupted parameters."""
    proc = launch_run(3, "ddp", tmp_path, ("--max-restarts", "2"), env={"FAULT_KILL": "1:4"})
    assert proc.returncode == 0, proc.stderr
    assert (f"disttrain launch: rank 1 was killed by {signal.SIGKILL.name}; restarting all 3 "
            f"local worker(s) (restart 1 of 2)") in proc.stderr
    assert f"restart 1 of this job: resuming from {tmp_path}" in proc.stderr
    assert json.loads((tmp_path / "result.json").read_text())["start_step"] == 2
    got, _ = zero.consolidate(tmp_path / "step-00000006" / "universal")
    want, _ = pools(3).run(rank_train, dataclasses.replace(CONFIG, strategy="ddp"))[0]
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


def test_zero2_resumes_on_fewer_ranks(pools, tmp_path):
    """Three ranks, one killed after step 3 and no restarts: the job fails. Launched again
    on two ranks with --resume, ZeRO reshards the step-2 checkpoint and finishes like an
    uninterrupted three-rank run (up to the order of floating-point sums)."""
    failed = launch_run(3, "zero2", tmp_path, env={"FAULT_KILL": "2:3"})
    assert failed.returncode == 128 + signal.SIGKILL, failed.stderr
    assert (tmp_path / "latest").read_text() == "step-00000002"
    proc = launch_run(2, "zero2", tmp_path, run_args=("--resume",))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["start_step"] == 2 and result["world_size"] == 2
    got, _ = zero.consolidate(tmp_path / "step-00000006" / "universal")
    want, _ = pools(3).run(rank_train, dataclasses.replace(CONFIG, strategy="zero2"))[0]
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
