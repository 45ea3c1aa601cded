"""Shared bits of the launch tests: script paths, running the launcher, process checks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from disttrain.launch.config import LaunchConfig
from disttrain.launch.launcher import launch

SCRIPTS = Path(__file__).parent
LAUNCH_TIMEOUT_S = 150  # a whole launch, far above what it needs: only a hang reaches it


def run_in_process(capfd: Any, script: str, *args: str, **config: Any) -> tuple[int, str, str]:
    """``disttrain launch`` in this process (saves the launcher's own start-up)."""
    code = launch(LaunchConfig(str(SCRIPTS / script), args=args, **config))
    out, err = capfd.readouterr()
    return code, out, err


def run_cli(*argv: str, env: dict[str, str] | None = None,
            timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``python -m disttrain ARGV`` in a new process."""
    return subprocess.run([sys.executable, "-m", "disttrain", *argv], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def json_lines(text: str) -> dict[int, dict[str, Any]]:
    """``[rank R] {json}`` reports → {R: object} (the last of each rank). A report need not
    start a line: mpirun forwards each rank's output as it reads it, and two ranks' reports
    have arrived glued together (``{...}[rank 1] {...}``)."""
    found, decoder = {}, json.JSONDecoder()
    for match in re.finditer(r"\[rank (\d+)\] (?=\{)", text):
        with contextlib.suppress(json.JSONDecodeError):  # a prefix before other text
            found[int(match.group(1))] = decoder.raw_decode(text, match.end())[0]
    return found


def is_gone(pid: int) -> bool:
    """Dead (or a zombie waiting for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def assert_all_gone(piddir: Path, expected: int, wait_s: float = 5.0) -> None:
    """Every pid written to ``piddir`` is gone (within ``wait_s``: signals take a moment)."""
    pids = {f.name: int(f.read_text()) for f in piddir.glob("pid-*")}
    assert len(pids) == expected, f"expected {expected} pid files, found {sorted(pids)}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(is_gone(p) for p in pids.values()):
        time.sleep(0.1)
    alive = {name: f"{pid} {_state_of(pid)}" for name, pid in pids.items() if not is_gone(pid)}
    assert not alive, f"left behind (pid, state, parent, process group): {alive}"


def _state_of(pid: int) -> str:
    """``T ppid 1 pgrp 4711`` from /proc (what a leftover process was doing, and whose)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "gone"
    return f"{fields[0]} ppid {fields[1]} pgrp {fields[2]}"


def error_record(run_dir: Path, rank: int) -> dict[str, Any]:
    return json.loads((run_dir / f"error-rank{rank}.json").read_text())["disttrain"]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any placement or disttrain variables (a plain
    ``python`` start: a world of one), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC", "LOCAL_",
                                "SLURM_", "DISTTRAIN_"))}
    return {**env, **extra}
