"""A rank that raises and then cannot finish exiting (tests of the bounded exit).

Usage: exit_hang.py MODE PIDDIR, run with DISTTRAIN_EXIT_TIMEOUT set low. The rank that
fails (rank 1 when there are several, else rank 0) raises ``ValueError`` after making its
own exit hang:

thread  a non-daemon thread never ends, so interpreter shutdown waits for it forever
late    an exit handler cancels faulthandler's watchdog and then sleeps (as a hang after
        Python's own shutdown would escape it), leaving only the SIGALRM backstop
The other ranks sleep until they are stopped.
"""

import atexit
import faulthandler
import os
import sys
import threading
import time

import disttrain

mode, piddir = sys.argv[1], sys.argv[2]
comm = disttrain.init()
with open(os.path.join(piddir, f"pid-rank{comm.rank}"), "w") as f:
    f.write(str(os.getpid()))
if comm.rank != comm.world_size - 1:
    time.sleep(120)
    sys.exit(0)


def never_ends() -> None:
    threading.Event().wait()


def cancel_watchdog_then_sleep() -> None:
    faulthandler.cancel_dump_traceback_later()
    time.sleep(120)


if mode == "thread":
    threading.Thread(target=never_ends, name="never-ends").start()
elif mode == "late":
    atexit.register(cancel_watchdog_then_sleep)
else:
    raise SystemExit(f"unknown mode {mode!r}")
raise ValueError(f"rank {comm.rank} fails and its exit hangs")
