"""A rank blocked inside a C call that no signal interrupts, as a store call to an
unreachable host is: a TCPStore client waits on a store server that is SIGSTOPped (a child
of this rank, in its process group). argv[1] is a directory for pid files; prints "ready"
once blocked is imminent."""

import datetime
import os
import signal
import subprocess
import sys

import torch.distributed as dist

import disttrain

piddir = sys.argv[1]
comm = disttrain.init()
with open(os.path.join(piddir, f"pid-rank{comm.rank}"), "w") as f:
    f.write(str(os.getpid()))
serve = ("import datetime, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, None, "
         "True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False); "
         "print(s.port, flush=True); time.sleep(600)")
server = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
with open(os.path.join(piddir, f"pid-server{comm.rank}"), "w") as f:
    f.write(str(server.pid))
assert server.stdout is not None
port = int(server.stdout.readline())
# a timeout longer than any test waits: with a short one the call ends on its own (while
# the other rank is still starting its server on a busy machine), and the rank with it
client = dist.TCPStore("127.0.0.1", port, None, False,
                       timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
client.set("key", "1")
os.kill(server.pid, signal.SIGSTOP)
print("ready", flush=True)
client.check(["key"])  # never returns: the server is stopped, and SIGTERM does not help
