"""No shared-memory segment survives a rank SIGKILLed at any moment of the shared-memory
transport's set-up, under ``disttrain launch`` and under ``disttrain run -n 2``: between
creating the segment and every rank attaching it, its name is in /dev/shm, and the killed
rank's resource tracker (which would remove it) dies with its process group. Launchers tag
their ranks' segments and remove what is left once the ranks are gone.

The kill is placed exactly in that window by tests/launch_scripts/faults/sitecustomize.py
(imported at start-up by every process of the run through PYTHONPATH)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain.comm.transports.shm.segment import unlink_tagged
from tests.launch_scripts.harness import LAUNCH_TIMEOUT_S, SCRIPTS, clean_env

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[1]
CASES = [("launch", "0:opened"), ("launch", "0:attached"), ("run", "0:opened"),
         ("run", "1:attached")]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
@pytest.mark.parametrize("launcher, kill", CASES)
def test_a_rank_killed_during_shm_set_up_leaves_no_segment(tmp_path, launcher, kill):
    env = clean_env(DISTTRAIN_TEST_SHM_KILL=kill, DISTTRAIN_TEST_DIR=str(tmp_path),
                    DISTTRAIN_TIMEOUT="20",
                    PYTHONPATH=os.pathsep.join([str(SCRIPTS / "faults"), str(ROOT)]))
    if launcher == "launch":
        argv = ["launch", "-n", "2", str(SCRIPTS / "shm_setup.py")]
    else:
        argv = ["run", "-n", "2", "--transport", "shm", "--strategy", "ddp", "--model", "mlp",
                "--steps", "1"]
    done = subprocess.run([sys.executable, "-m", "disttrain", *argv], capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT_S, env=env, cwd=tmp_path)
    assert done.returncode != 0, done.stderr[-3000:]
    assert "killed by SIGKILL" in done.stderr, done.stderr[-3000:]
    name = (tmp_path / "segment").read_text()  # the kill happened in the window
    assert name.startswith("disttrain-shm-")
    assert not os.path.exists(f"/dev/shm/{name}"), f"{name} left in /dev/shm"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
@pytest.mark.parametrize("kill", ["0:opened", "0:created"])
def test_under_torchrun_a_rank_killed_during_shm_set_up_leaves_no_segment(tmp_path, kill):
    """torchrun (like srun and mpirun) tags no names and removes nothing: the surviving
    rank knows the name before the segment exists and removes it when set-up fails."""
    env = clean_env(DISTTRAIN_TEST_SHM_KILL=kill, DISTTRAIN_TEST_DIR=str(tmp_path),
                    DISTTRAIN_TIMEOUT="20",
                    PYTHONPATH=os.pathsep.join([str(SCRIPTS / "faults"), str(ROOT)]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(SCRIPTS / "shm_setup.py")],
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env,
                          cwd=tmp_path)
    assert done.returncode != 0, done.stderr[-3000:]
    name = (tmp_path / "segment").read_text()  # the kill happened in the window
    assert name.startswith("disttrain-shm-")
    assert not os.path.exists(f"/dev/shm/{name}"), f"{name} left in /dev/shm"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_clean_up_leaves_entries_it_cannot_or_must_not_remove():
    """An entry with the job's tag that is a directory, or another user's file, stays (with
    a warning) instead of failing the run's clean-up; this user's segment goes."""
    tag = f"t{os.getpid()}{secrets.token_hex(3)}"
    base = f"/dev/shm/disttrain-shm-{tag}-"
    mine, folder, theirs = base + "aaaa", base + "bbbb", base + "cccc"
    Path(mine).write_bytes(b"\0" * 64)
    os.mkdir(folder)
    Path(theirs).write_bytes(b"\0" * 64)
    try:
        if os.geteuid() == 0:
            os.chown(theirs, 54321, 54321)
        else:
            os.unlink(theirs)
        assert unlink_tagged(tag) == [os.path.basename(mine)]
        assert not os.path.exists(mine) and os.path.isdir(folder)
        assert os.path.exists(theirs) == (os.geteuid() == 0)
    finally:
        for path in (mine, theirs):
            if os.path.exists(path):
                os.unlink(path)
        os.rmdir(folder)
