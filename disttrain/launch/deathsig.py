"""Exec wrapper: have Linux SIGTERM this process when the launcher dies, then become the worker.

    python -I -S deathsig.py LAUNCHER_PID PROGRAM [ARG ...]

``PR_SET_PDEATHSIG`` must be set by the child itself. Setting it between fork and exec
(subprocess's ``preexec_fn``) runs Python code in a forked copy of the launcher, which can
deadlock once the launcher runs threads (the rendezvous store's server, the output readers,
or whatever a program embedding :func:`disttrain.launch.launch` runs). This script does it
in a fresh, single-threaded interpreter instead, then ``execv``s the worker in the same
process: the pid the launcher watches and signals does not change, and the setting survives
the exec (Linux clears it only for set-user-ID and set-group-ID programs).

Run as a script with ``-I -S`` it imports nothing but the standard library (it starts in a
few milliseconds); it must not import disttrain. Ranks that run a Python function
(:class:`disttrain.launch.ranks.LocalRanks`) call :func:`set_parent_death_signal` directly.

The signal goes to a worker that may be blocked inside a C call (a store or network wait),
where Python runs no handler until the call returns: a worker whose launcher is gone
therefore also ends itself shortly after that SIGTERM (``disttrain.launch.hooks``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int, parent: int) -> bool:
    """Have Linux send ``signum`` to this process when ``parent`` (its parent) dies; end at
    once if it died already. False where prctl is not available (no safety net)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum))
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    return True


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        sys.exit("usage: deathsig.py LAUNCHER_PID PROGRAM [ARG ...]")
    set_parent_death_signal(signal.SIGTERM, int(argv[1]))
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv)
