"""One worker process: spawned in its own process group, its output prefixed with its rank.

Each worker is a session leader (``start_new_session``), so the launcher can signal it and
everything it started (data-loader workers, shells) with one ``killpg``, and a Ctrl-C in
the terminal reaches only the launcher, which decides what the workers get. On Linux a
worker also gets SIGTERM if the launcher itself dies (``PR_SET_PDEATHSIG``, set by the tiny
exec wrapper :mod:`disttrain.launch.deathsig`), so a killed launcher leaves no orphans. Two
reader threads copy its stdout and stderr line by line, each line prefixed ``[rank R] ``,
and keep the last stderr lines for the failure summary.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

_TAIL_LINES = 40
_DEATHSIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deathsig.py")


def with_parent_death_signal(argv: Sequence[str]) -> list[str]:
    """``argv`` started through :mod:`disttrain.launch.deathsig` on Linux, so the worker gets
    SIGTERM when this process dies. (Not a ``preexec_fn``: running Python between fork and
    exec is unsafe in a process with threads, and the launcher has some.)"""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", _DEATHSIG, str(os.getpid()), *argv]


class Worker:
    """A running worker and what the launcher knows about it."""

    def __init__(self, rank: int, local_rank: int, argv: Sequence[str],
                 env: Mapping[str, str]) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.error_file = env.get("DISTTRAIN_ERROR_FILE", "")
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.returncode: int | None = None
        self.exited_at: float | None = None
        # No preexec_fn: the child runs no Python code before exec, so spawning is safe
        # whatever threads this process runs (and subprocess can use vfork).
        self.popen = subprocess.Popen(
            with_parent_death_signal(argv), env=dict(env), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._readers: list[threading.Thread] = []

    @property
    def pid(self) -> int:
        return self.popen.pid

    def start_output(self, lock: threading.Lock, prefix: bool) -> None:
        """Start copying the worker's output to ours (call after every worker is spawned)."""
        tag = f"[rank {self.rank}] ".encode() if prefix else b""
        assert self.popen.stdout is not None and self.popen.stderr is not None
        for stream, sink, tail in ((self.popen.stdout, sys.stdout, None),
                                   (self.popen.stderr, sys.stderr, self.stderr_tail)):
            thread = threading.Thread(target=_pump, args=(stream, sink, tag, tail, lock),
                                      name=f"disttrain-out-r{self.rank}", daemon=True)
            thread.start()
            self._readers.append(thread)

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self.popen.poll()
            if code is not None:
                self.returncode, self.exited_at = code, time.time()
        return self.returncode

    def alive(self) -> bool:
        return self.poll() is None

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker and everything in its process group."""
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already

    def wait(self) -> int:
        code = self.popen.wait()
        self.poll()
        return code

    def join_output(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._readers:
            thread.join(max(0.0, deadline - time.monotonic()))


def _pump(stream: IO[bytes], sink: IO[str], tag: bytes,
          tail: collections.deque[str] | None, lock: threading.Lock) -> None:
    out = getattr(sink, "buffer", None)
    for raw in iter(stream.readline, b""):
        line = raw if raw.endswith(b"\n") else raw + b"\n"
        if tail is not None:
            tail.append(line.decode(errors="replace"))
        with lock:
            try:
                if out is not None:
                    sink.flush()
                    out.write(tag + line)
                    out.flush()
                else:
                    sink.write((tag + line).decode(errors="replace"))
                    sink.flush()
            except (OSError, ValueError):
                pass  # our own output is closed (e.g. a broken pipe): keep draining
    stream.close()
