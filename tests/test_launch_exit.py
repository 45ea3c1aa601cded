"""A rank must *end*, and end cleanly. A rank that fails has its exit bounded by
DISTTRAIN_EXIT_TIMEOUT (disttrain.launch.hooks.bound_exit), however interpreter shutdown
hangs: each of those tests fails on code without the bound by running into its subprocess or
launch time limit. A rank that calls disttrain.shutdown leaves no process group behind for
interpreter shutdown to free (which aborted about one exit in eight)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from disttrain.launch.hooks import _ALARM_AFTER_S
from tests.launch_scripts.harness import (
    SCRIPTS,
    assert_all_gone,
    clean_env,
    error_record,
    json_lines,
    run_in_process,
)

pytestmark = pytest.mark.timeout(240)
LIMIT_S = 90  # far above the 1 s bound plus a start-up: only a hang reaches it


def _run(mode: str, tmp_path) -> subprocess.CompletedProcess[str]:
    env = clean_env(DISTTRAIN_EXIT_TIMEOUT="1", DISTTRAIN_ERROR_FILE=str(tmp_path / "error.json"))
    return subprocess.run([sys.executable, str(SCRIPTS / "exit_hang.py"), mode, str(tmp_path)],
                          capture_output=True, text=True, timeout=LIMIT_S, env=env)


def test_a_failing_rank_whose_shutdown_hangs_is_stopped_with_its_stacks(tmp_path):
    done = _run("thread", tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    err = done.stderr
    # the error itself was reported first, in full, then the watchdog's dump of every thread
    assert err.index("ValueError: rank 0 fails and its exit hangs") < err.index(
        "Timeout (0:00:01)!")
    assert "in never_ends" in err  # the thread that holds the exit, by its function
    record = json.loads((tmp_path / "error.json").read_text())["disttrain"]
    assert record["message"] == "ValueError: rank 0 fails and its exit hangs"


def test_a_hang_after_the_watchdog_is_gone_meets_the_alarm(tmp_path):
    done = _run("late", tmp_path)  # the exit handler sleeps 120 s: LIMIT_S (90) if no alarm
    assert done.returncode == -signal.SIGALRM, done.stderr[-3000:]
    assert "Timeout (" not in done.stderr  # the faulthandler watchdog was cancelled


def test_zero_turns_the_bound_off(tmp_path):
    """The same hang with DISTTRAIN_EXIT_TIMEOUT=0 outlives its reported error past both the
    watchdog and the SIGALRM backstop that would end it with a bound (which also shows that
    the scenario above really hangs without the bound)."""
    env = clean_env(DISTTRAIN_EXIT_TIMEOUT="0")
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "exit_hang.py"), "thread",
                             str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stderr is not None
        # the error is reported, then the exit hangs: stderr stays open, so stop reading at
        # the error's line (the module's time limit bounds a run that never gets there)
        failed = any("ValueError: rank 0 fails and its exit hangs" in line
                     for line in proc.stderr)
        assert failed, f"the rank ended (status {proc.wait(timeout=30)}) without failing"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=_ALARM_AFTER_S + 3)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_an_error_at_the_interactive_prompt_does_not_end_the_session(tmp_path):
    """In ``python -i`` an uncaught error returns to the prompt: no exit to bound."""
    env = clean_env(DISTTRAIN_EXIT_TIMEOUT="1")
    commands = ("import time, disttrain\ncomm = disttrain.init()\n"
                "raise ValueError('at the prompt')\ntime.sleep(8)\nprint('still here')\n")
    done = subprocess.run([sys.executable, "-i", "-q"], input=commands, capture_output=True,
                          text=True, timeout=LIMIT_S, env=env)
    assert "ValueError: at the prompt" in done.stderr
    assert "still here" in done.stdout and done.returncode == 0, done.stderr[-2000:]


def test_the_launcher_reports_a_rank_that_failed_but_could_not_exit(capfd, tmp_path,
                                                                    monkeypatch):
    """Rank 1 raises and its exit hangs; rank 0 sleeps. Without the bound the launcher would
    wait for rank 1 forever; with it rank 1 ends, is named, and rank 0 is stopped."""
    monkeypatch.setenv("DISTTRAIN_EXIT_TIMEOUT", "1")
    run_dir = tmp_path / "run"
    code, _, err = run_in_process(capfd, "exit_hang.py", "thread", str(tmp_path),
                                  nproc_per_node=2, run_dir=str(run_dir))
    assert code == 1, err
    assert "rank 1 failed first; it exited with code 1" in err
    assert error_record(run_dir, 1)["message"] == ("ValueError: rank 1 fails and its exit "
                                                    "hangs")
    assert_all_gone(tmp_path, expected=2)


@pytest.mark.parametrize("how", ["comm", "no-arg", "exit"])
def test_shutdown_frees_every_process_group_before_interpreter_shutdown(capfd, how):
    """A Gloo group still referenced when the interpreter shuts down is freed there, and that
    aborted report_placement.py ("terminate called without an active exception", SIGABRT)
    in 2 of 12 and 1 of 16 runs: disttrain's transports kept the group alive after
    destroy_process_group. Closed communicators now drop it, and say so when used; a script
    that never calls disttrain.shutdown (``exit``) is shut down by disttrain's exit handler."""
    code, out, err = run_in_process(capfd, "release.py", how, nproc_per_node=2)
    assert code == 0, err
    seen = json_lines(out)
    assert sorted(seen) == [0, 1], out
    for report in seen.values():
        assert report["sum"] == [4.0, 4.0, 4.0]  # the pair, then shm, each summed two ranks
        assert report["world_pg_freed"] and report["sub_pg_freed"], report
        for name, error in report["after_close"].items():
            assert error.startswith("CommError: this communicator was closed"), (name, error)


def test_an_unfinished_polled_send_does_not_abort_the_exit(capfd):
    """Rank 0 polled a send that rank 1 never receives, then calls disttrain.shutdown(): the
    thread waiting for it is joined before the group goes, with a warning naming the message
    (a daemon thread woke during interpreter finalization and aborted the rank)."""
    code, out, err = run_in_process(capfd, "pending_p2p.py", nproc_per_node=2)
    assert code == 0, err
    assert "terminate called" not in err
    assert "polled: False" in out and "rank 0 done" in out and "rank 1 done" in out, out
    assert ("leaves the process group with 1 polled point-to-point message(s) unfinished "
            "(send #1 to rank 1)") in err, err


class _FakeComm:
    def __init__(self, unfinished: int, failed: bool, closed: bool = False) -> None:
        self.rank, self.unfinished, self.failed, self.closed = 0, unfinished, failed, closed


@pytest.mark.parametrize("case, shuts_down, warning", [
    ("clean", True, None),  # a script that ended without disttrain.shutdown(): done for it
    ("group destroyed by the script", True, None),  # the comm still holds it: closed
    ("async collectives running", False, "asynchronous collectives are unfinished"),
    ("communicator failed", False, "the communicator of rank 0 has failed"),
    # a run that went on without a dead peer closed its communicators: nothing can hang
    ("failed communicator closed", True, None),
    # on the way out of an error of its own, a healthy Gloo group is freed too (left to
    # interpreter shutdown it aborted about one exit in seven)
    ("failing", True, None),
    ("failing with polled messages in flight", False, None),  # their wait could hang
    ("failing on nccl", False, None),
    ("forked child", False, None),  # the parent's group is not the child's to destroy
])
def test_the_exit_handler_shuts_down_only_when_nothing_can_hang(monkeypatch, caplog, case,
                                                                 shuts_down, warning):
    from disttrain.launch import hooks, join

    comm = _FakeComm(unfinished=2 if case == "async collectives running" else 0,
                     failed=case.startswith(("communicator failed", "failed communicator")),
                     closed=case == "failed communicator closed")
    calls, bounded = [], []
    monkeypatch.setattr(join, "_opened", [lambda: comm])
    monkeypatch.setattr(join, "_init_pid", os.getpid() + (case == "forked child"))
    monkeypatch.setattr(join, "shutdown", lambda c=None: calls.append(c))
    monkeypatch.setattr(join.dist, "is_initialized",
                        lambda: case != "group destroyed by the script")
    monkeypatch.setattr(hooks, "is_failing", lambda: case.startswith("failing"))
    monkeypatch.setattr(join.dist, "get_backend",
                        lambda: "nccl" if case == "failing on nccl" else "gloo")
    monkeypatch.setattr(join, "polled_messages", lambda: int("polled" in case))
    monkeypatch.setattr(hooks, "bound_exit", lambda: bounded.append("bound") or True)
    monkeypatch.setattr(hooks, "release_exit_bound", lambda: bounded.append("released"))
    join._shutdown_at_exit()
    assert calls == ([None] if shuts_down else [])
    # the shutdown itself cannot hang the exit; the user's own exit handlers are not bounded
    assert bounded == (["bound", "released"] if shuts_down else [])
    if warning:
        assert warning in caplog.text
    else:
        assert "exiting without disttrain.shutdown()" not in caplog.text


def test_the_exit_handler_gives_the_exit_back_after_its_shutdown():
    """A script without disttrain.shutdown(): the exit handler's shutdown is bounded, then
    the bound is lifted. The script's own exit handler (registered before init, so it runs
    after disttrain's) finds its SIGALRM handler and timer again and may take longer than
    the bound without being killed."""
    script = """if True:
        import atexit, signal, time
        def mine(signum, frame):
            print("my alarm", flush=True)
        signal.signal(signal.SIGALRM, mine)
        signal.setitimer(signal.ITIMER_REAL, 300)
        def slow_upload():
            print("handler", signal.getsignal(signal.SIGALRM) is mine,
                  round(signal.getitimer(signal.ITIMER_REAL)[0]), flush=True)
            time.sleep(4)  # longer than the 1 s bound and its 5 s backstop minus the wait
            print("uploaded", flush=True)
        atexit.register(slow_upload)
        import disttrain
        comm = disttrain.init()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_REAL, 3)  # fires only if the bound had not given it back
        time.sleep(0.1)
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=LIMIT_S, env=clean_env(DISTTRAIN_EXIT_TIMEOUT="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "handler True 3", done.stdout  # the user's handler and timer, back
    assert "uploaded" in lines and "Timeout (" not in done.stderr, (done.stdout, done.stderr)
