"""The files a failed run leaves behind, written by workers and read by the launcher.

* **Error record** (one per rank, ``$DISTTRAIN_ERROR_FILE``): the exception, its traceback,
  where the flight-recorder dump went and, when known, the root cause. It uses the JSON
  layout of torch's ``TORCHELASTIC_ERROR_FILE`` (``{"message": {"message", "extraInfo":
  {"py_callstack", "timestamp"}}}``) plus a ``"disttrain"`` section, so torchrun shows our
  tracebacks instead of ``error_file: <N/A>`` and we read the files torch's ``@record`` writes.
* **Failure notice** (``$DISTTRAIN_RUN_DIR/failure.json``): written by the launcher *before*
  it stops the survivors, so each can say which rank failed first.
* **Launcher pid** (``$DISTTRAIN_LAUNCHER_PID``): a worker whose parent is no longer that
  process has lost its launcher and ends itself (``hooks``).
* **Flight-recorder dump** (``$DISTTRAIN_FLIGHT_DIR/flight-rank<R>.json``): the
  communicator's last collectives (see ``disttrain.comm.flight_recorder``). Without
  DISTTRAIN_FLIGHT_DIR (torchrun, srun, mpirun) it goes to this user's private directory,
  ``$TMPDIR/disttrain-<uid>/flight-rank<R>-pid<P>.json`` (:func:`~disttrain.private_files.
  private_dir`: 0700, owner checked), never to a shared, predictable path.

Every file is written through :func:`disttrain.private_files.atomic_write`: a fresh name
created with O_EXCL | O_NOFOLLOW, renamed over the target, so no link another user planted
is ever written through, and a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from disttrain import private_files

ERROR_FILE_VAR = "DISTTRAIN_ERROR_FILE"
TORCH_ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
RUN_DIR_VAR = "DISTTRAIN_RUN_DIR"
FLIGHT_DIR_VAR = "DISTTRAIN_FLIGHT_DIR"
LAUNCHER_PID_VAR = "DISTTRAIN_LAUNCHER_PID"
FAILURE_NOTICE = "failure.json"


@dataclass(frozen=True)
class ErrorRecord:
    """Why one rank stopped."""

    message: str  # "ValueError: boom"
    traceback: str
    timestamp: float
    kind: str = "exception"  # "exception", or "terminated" by a signal
    rank: int | None = None
    host: str = ""
    pid: int | None = None
    flight_file: str | None = None
    root_cause: str | None = None  # the launcher's notice, when another rank failed first
    suspects: tuple[int, ...] = ()  # the ranks this one's communicator blamed (dead, silent)

    def to_json(self) -> dict[str, Any]:
        torch_part = {"message": self.message, "extraInfo": {
            "py_callstack": self.traceback, "timestamp": str(int(self.timestamp))}}
        return {"message": torch_part, "disttrain": asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ErrorRecord:
        """Read our records and torch's (``@record``) alike."""
        ours = data.get("disttrain")
        if isinstance(ours, Mapping):
            known = {k: ours[k] for k in cls.__dataclass_fields__ if k in ours}
            known["suspects"] = tuple(int(r) for r in known.get("suspects") or ())
            return cls(**known)
        message = data.get("message", "")
        if isinstance(message, Mapping):
            extra = message.get("extraInfo", {})
            return cls(str(message.get("message", "")), str(extra.get("py_callstack", "")),
                       float(extra.get("timestamp", 0) or 0))
        return cls(str(message), "", float(data.get("timestamp", 0) or 0))


def write_json(path: str | Path, data: Any) -> Path:
    """Write atomically, never through a link (see the module docstring); a missing
    directory is made private (0700)."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return private_files.write_text(path, json.dumps(data, indent=1) + "\n", mode=0o600)


def read_json(path: str | Path) -> Any | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_error_record(path: str | Path) -> ErrorRecord | None:
    data = read_json(path)
    if not isinstance(data, Mapping):
        return None
    try:
        return ErrorRecord.from_json(data)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class FailureNotice:
    """The launcher's word on which rank failed first, and how."""

    rank: int
    host: str
    pid: int
    how: str  # "was killed by SIGKILL", "exited with code 1"
    message: str = ""  # its error, when it left a record

    def describe(self) -> str:
        text = f"rank {self.rank} (pid {self.pid} on {self.host}) {self.how}"
        return f"{text}: {self.message}" if self.message else text


def write_failure_notice(run_dir: str | Path, notice: FailureNotice) -> Path:
    return write_json(Path(run_dir) / FAILURE_NOTICE, asdict(notice))


def read_failure_notice(run_dir: str | Path | None) -> FailureNotice | None:
    if not run_dir:
        return None
    data = read_json(Path(run_dir) / FAILURE_NOTICE)
    if not isinstance(data, Mapping):
        return None
    try:
        return FailureNotice(**{k: data[k] for k in FailureNotice.__dataclass_fields__
                                if k in data})
    except TypeError:
        return None


def wait_for_failure_notice(run_dir: str | Path | None, timeout_s: float) -> FailureNotice | None:
    """The notice, waiting up to ``timeout_s`` for the launcher to write it."""
    deadline = time.monotonic() + timeout_s
    while True:
        notice = read_failure_notice(run_dir)
        if notice is not None or not run_dir or time.monotonic() >= deadline:
            return notice
        time.sleep(0.05)


def flight_file(rank: int, env: Mapping[str, str], index: int = 0) -> Path:
    """Where rank ``rank`` dumps its flight recorder: ``$DISTTRAIN_FLIGHT_DIR`` (the launcher
    sets it to its run directory), else this user's private directory, named by pid
    (PermissionError when that directory is not private: see :func:`private_dir`)."""
    suffix = f"-comm{index}" if index else ""
    directory = env.get(FLIGHT_DIR_VAR)
    if directory:
        return Path(directory) / f"flight-rank{rank}{suffix}.json"
    return private_files.private_dir() / f"flight-rank{rank}-pid{os.getpid()}{suffix}.json"


def last_collective(path: str | Path | None) -> dict[str, Any] | None:
    """The newest record of a flight-recorder dump, or None."""
    if not path:
        return None
    data = read_json(path)
    records = data.get("records") if isinstance(data, Mapping) else None
    if not records:
        return None
    last = records[-1]
    return last if isinstance(last, dict) else None
