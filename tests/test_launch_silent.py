"""A silent rank (SIGSTOP) under ``disttrain launch -n 3`` and ``disttrain run -n 3``: the
job exits non-zero within timeout + 5 s of the stop, the stopped rank is named in the
headline (not a survivor that timed out waiting for it), and no process is left behind.

The full matrix is SIGSTOP × {rank 0, middle, last} × {collective, compute, start-up} × both
launchers: 18 cells of about 15 s each on a 2-core machine. CI runs the representative
cells in ``CI_CELLS`` (every launcher and every phase at least once); set
DISTTRAIN_FULL_FAULT_MATRIX=1 for all of them. The training is ``disttrain run --strategy
ddp`` with tests/launch_scripts/silent.py's model, whose victim stops itself in the
collective and compute phases; at start-up it stops on entering the rendezvous, before it
has published itself (tests/launch_scripts/faults/sitecustomize.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch_scripts.harness import clean_env, is_gone

pytestmark = pytest.mark.timeout(180)
TIMEOUT_S, INIT_TIMEOUT_S = 5.0, 8.0
# The job must end within its deadline (the timeout, then 5 s for the launcher to stop the
# rest) plus a margin of several seconds for a shared, loaded 2-core machine. What the bound
# tells apart is ending on the deadline from hanging (the test's own 180 s timeout).
MARGIN_S = 15.0
STARTUP_MARGIN_S = 20.0  # + how much later than the victim the survivors arrive (imports)
RUN = ["run", "--strategy", "ddp", "--model", "tests.launch_scripts.silent:model",
       "--dataset", "digits", "--steps", "6", "--global-batch", "30"]
PHASES = ("collective", "compute", "startup")
ALL_CELLS = [(launcher, victim, phase) for launcher in ("launch", "run")
             for victim in (0, 1, 2) for phase in PHASES]
CI_CELLS = [("launch", 1, "collective"), ("launch", 0, "startup"), ("run", 2, "compute"),
            ("run", 1, "startup")]
CELLS = ALL_CELLS if os.environ.get("DISTTRAIN_FULL_FAULT_MATRIX") == "1" else CI_CELLS
ROOT = Path(__file__).resolve().parents[1]


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (by parent pid, from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if stat:
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in found]
        found.update(children)
        todo += children
    return found


@pytest.mark.parametrize("launcher, victim, phase", CELLS)
def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path, launcher, victim, phase):
    env = clean_env(DISTTRAIN_TIMEOUT=str(TIMEOUT_S), DISTTRAIN_INIT_TIMEOUT=str(INIT_TIMEOUT_S),
                    DISTTRAIN_TEST_DIR=str(tmp_path), DISTTRAIN_TEST_VICTIM=str(victim),
                    DISTTRAIN_TEST_PHASE=phase,
                    PYTHONPATH=os.pathsep.join([str(ROOT / "tests/launch_scripts/faults"),
                                                str(ROOT)]))
    argv = ([sys.executable, "-m", "disttrain", "launch", "-n", "3", "-m", "disttrain", *RUN]
            if launcher == "launch" else [sys.executable, "-m", "disttrain", *RUN[:1], "-n",
                                          "3", *RUN[1:]])
    errors = open(tmp_path / "stderr.txt", "w+")  # a file: a pipe could fill while we poll
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors, text=True,
                            env=env, cwd=tmp_path, start_new_session=True)
    seen: set[int] = set()
    try:
        while proc.poll() is None:
            seen |= _descendants(proc.pid)
            time.sleep(0.05)
        ended_at = time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        errors.close()
    err = (tmp_path / "stderr.txt").read_text()
    stopped_at = float((tmp_path / "stopped-at").read_text())
    assert proc.returncode != 0, err[-3000:]
    bound = (INIT_TIMEOUT_S + 5 + STARTUP_MARGIN_S if phase == "startup"
             else TIMEOUT_S + 5 + MARGIN_S)
    assert ended_at - stopped_at < bound, (ended_at - stopped_at, err[-3000:])
    if launcher == "launch":
        headline = re.search(r"^disttrain launch: rank (\d+) failed first; it (.*)$", err, re.M)
    else:
        headline = re.search(r"^disttrain run: rank (\d+) (.*)$", err, re.M)
    assert headline is not None, err[-3000:]
    assert int(headline.group(1)) == victim, headline.group(0)
    assert headline.group(2).startswith("was stopped (SIGSTOP"), headline.group(0)
    left = {pid for pid in seen if not is_gone(pid)}
    deadline = time.monotonic() + 5
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {pid for pid in left if not is_gone(pid)}
    assert not left, f"left behind: {left}"
    print(f"{launcher} victim={victim} {phase}: ended {ended_at - stopped_at:.1f}s after the "
          "stop")  # shown with -s: the numbers for the report


def test_disttrain_run_names_a_killed_rank_with_its_signal_and_operation(tmp_path):
    """As disttrain launch does: the signal, and the collective its peers were in."""
    env = clean_env(DISTTRAIN_TIMEOUT="30", DISTTRAIN_TEST_DIR=str(tmp_path),
                    DISTTRAIN_TEST_VICTIM="1", DISTTRAIN_TEST_PHASE="killed",
                    PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "disttrain", RUN[0], "-n", "3", *RUN[1:]],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert re.search(r"^disttrain run: rank 1 died: was killed by SIGKILL; its peers were in "
                     r"all_reduce #\d+$", done.stderr, re.M), done.stderr[-3000:]


def test_a_killed_disttrain_run_takes_its_ranks_with_it(tmp_path):
    """disttrain run -n 2's ranks get SIGKILL from the kernel when it dies (SIGKILL)."""
    proc = subprocess.Popen([sys.executable, "-m", "disttrain", "run", "-n", "2", "--strategy",
                             "ddp", "--model", "mlp", "--epochs", "100000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=clean_env(), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        ranks: set[int] = set()
        while len(ranks) < 2 and time.monotonic() < deadline:
            ranks = {p for p in _descendants(proc.pid) if _is_rank(p)}
            time.sleep(0.1)
        assert len(ranks) == 2
        time.sleep(1)  # past the start, in the child's own code
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(is_gone(p) for p in ranks):
            time.sleep(0.1)
        assert all(is_gone(p) for p in ranks), f"left behind: {ranks}"
    finally:
        proc.kill()
        proc.wait()


def _is_rank(pid: int) -> bool:
    """A process disttrain run spawned as a rank (not multiprocessing's resource tracker)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"--multiprocessing-fork" in cmdline and b"resource_tracker" not in cmdline
