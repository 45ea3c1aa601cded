"""Every launcher's contract with the real launcher: ``srun`` on a single-node Slurm started
for the session (tests/slurm_cluster.py) and OpenMPI's ``mpirun``, each running
``disttrain.init()`` (an all-reduce), ``disttrain run`` with DDP (one result, equal to
``disttrain run -n 2``'s), a parameter-server strategy, and a task killed mid-collective.
Skipped, with the reason, where Slurm or OpenMPI is not installed (CI installs both).

The command lines are the ones docs/launching.md shows.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.launch_scripts.harness import SCRIPTS, clean_env, json_lines

pytestmark = pytest.mark.timeout(240)
PY = sys.executable
RUN_DDP = ["-m", "disttrain", "run", "--strategy", "ddp", "--model", "mlp", "--dataset",
           "digits", "--steps", "3"]
RUN_PS = ["-m", "disttrain", "run", "--strategy", "ps-sync", "--servers", "1", "--model",
          "mlp", "--dataset", "digits", "--steps", "2"]
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]  # root; 2 cores, 3 ranks
TIMEOUT_S = 180


def _run(argv: list[str], env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**clean_env(), **(env or {})}, cwd=cwd)


def _results(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The ``result ...`` lines a disttrain run printed (one per job, from rank 0). Not
    anchored at a line start: mpirun forwards each rank's output as it reads it, so another
    rank's unfinished line can precede it."""
    return re.findall(r"result strategy=.*$", done.stdout, re.M)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``disttrain run -n 2`` with DDP: what every launcher must reproduce."""
    path = tmp_path_factory.mktemp("reference") / "result.json"
    done = _run([PY, *RUN_DDP, "-n", "2", "--json", str(path)])
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(path.read_text()))


def _same_training(done: subprocess.CompletedProcess[str], path: Path,
                   reference: dict[str, Any]) -> None:
    assert done.returncode == 0, done.stderr[-3000:]
    lines = _results(done)
    assert len(lines) == 1 and "world_size=2" in lines[0], done.stdout  # ONE two-rank job
    got = json.loads(path.read_text())
    for key in ("world_size", "steps", "final_loss", "eval_loss", "accuracy"):
        assert got[key] == reference[key], key


def _killed_task_is_named(done: subprocess.CompletedProcess[str], piddir: Path,
                          survivors: tuple[int, ...], launcher_named: bool = False) -> None:
    """Rank 1 SIGKILLed itself mid all-reduce; every survivor's error names it as dead,
    within 30 s with the default timeout (5 minutes): the kernel says it is gone. With
    ``launcher_named`` (mpirun, which aborts the job when a rank dies and says which) a
    survivor may be stopped by the launcher before it reports."""
    assert done.returncode != 0
    killed_at = float((piddir / "killed-at").read_text())
    reports = json_lines(done.stdout)
    if launcher_named:
        assert set(reports) <= set(survivors), done.stdout
    else:
        assert sorted(reports) == list(survivors), done.stdout + done.stderr[-3000:]
    for report in reports.values():
        assert report["suspects"] == [1], report
        assert re.search(r"rank 1 died \(pid \d+ on .* is gone\)", report["error"]), report
        # the kernel's word, not the 300 s timeout: 30 s leaves a loaded machine its margin
        assert report["at"] - killed_at < 30, report


# ------------------------------------------------------------------ Slurm (srun)
def test_srun_steps_that_overlap_each_meet_on_their_own(slurm, tmp_path):
    """Two srun steps of one job at the same time (job id alike, step ids differ): each
    derives its own rendezvous port, and every task of each sums over its own 2 ranks."""
    step = f"srun --exact -n2 {PY} {SCRIPTS / 'contract.py'} overlap {tmp_path}"
    done = _run(["salloc", "-n4", "bash", "-c", f"{step} & {step} & wait"], slurm.env)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(m) for m in re.findall(r"^\[rank \d\] (\{.*\})$", done.stdout, re.M)]
    assert sorted((r["step"], r["rank"]) for r in reports) == [
        ("0", 0), ("0", 1), ("1", 0), ("1", 1)], done.stdout
    assert all(r["world_size"] == 2 and r["sum"] == 6.0 for r in reports)


def test_srun_disttrain_run_is_one_job(slurm, reference, tmp_path):
    path = tmp_path / "srun.json"
    _same_training(_run(["srun", "-n2", PY, *RUN_DDP, "--json", str(path)], slurm.env),
                   path, reference)


def test_srun_parameter_server(slurm):
    done = _run(["srun", "-n3", PY, *RUN_PS], slurm.env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_results(done)) == 1 and "world_size=3" in _results(done)[0], done.stdout
    assert "ps mode=sync workers=2 servers=1" in done.stdout


def test_srun_killed_task_is_named(slurm, tmp_path):
    done = _run(["srun", "-n3", PY, str(SCRIPTS / "contract.py"), "kill", str(tmp_path)],
                slurm.env)
    _killed_task_is_named(done, tmp_path, survivors=(0, 2))
    assert "task 1: Killed" in done.stderr


# ------------------------------------------------------------------ OpenMPI (mpirun)
@pytest.fixture(scope="module")
def mpirun() -> list[str]:
    if shutil.which("mpirun") is None:
        pytest.skip("OpenMPI is not installed (apt-get install openmpi-bin)")
    return MPIRUN


def test_mpirun_init_sums_over_every_rank(mpirun, tmp_path):
    done = _run([*mpirun, "-np", "3", PY, str(SCRIPTS / "contract.py"), "sum", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    reports = json_lines(done.stdout)
    assert sorted(reports) == [0, 1, 2], done.stdout
    assert all(r["world_size"] == 3 and r["sum"] == 6.0 for r in reports.values())


def test_mpirun_disttrain_run_is_one_job(mpirun, reference, tmp_path):
    path = tmp_path / "mpirun.json"
    _same_training(_run([*mpirun, "-np", "2", PY, *RUN_DDP, "--json", str(path)]), path,
                   reference)


def test_mpirun_parameter_server(mpirun):
    done = _run([*mpirun, "-np", "3", PY, *RUN_PS])
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_results(done)) == 1 and "world_size=3" in _results(done)[0], done.stdout
    assert "ps mode=sync workers=2 servers=1" in done.stdout


def test_mpirun_killed_task_is_named(mpirun, tmp_path):
    done = _run([*mpirun, "-np", "3", PY, str(SCRIPTS / "contract.py"), "kill", str(tmp_path)])
    _killed_task_is_named(done, tmp_path, survivors=(0, 2), launcher_named=True)
    assert "process rank 1 with PID 0 on node" in done.stderr and "signal 9" in done.stderr


def test_ranks_on_several_machines_need_master_addr():
    """mpirun does not say where rank 0 runs: across machines that is an error saying how
    to pass it, not a guess."""
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_MCA_ess_base_jobid": "77"}
    done = _run([PY, str(SCRIPTS / "report_placement.py")], env)
    assert done.returncode == 1
    assert "pass it with mpirun -x MASTER_ADDR=<host of rank 0>" in done.stderr
