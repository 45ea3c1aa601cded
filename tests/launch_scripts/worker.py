"""A disttrain worker with one scenario per argv[1]; argv[2] is a directory for pid files.

ok       all-reduce and a monitored barrier, result printed as JSON
sigkill  rank 1 kills itself with SIGKILL while the others are in an all-reduce; rank 0 has
         started a grandchild (sleep) that must not outlive the job
raise    rank 1 raises while the others are in an all-reduce
stuck    rank 1 never joins the second all-reduce (DISTTRAIN_TIMEOUT bounds the others)
desync   ranks all-reduce tensors of different sizes (run with DISTTRAIN_DEBUG=1)
tworaise rank 1 raises at once; rank 0 raises 0.15 s after the launcher has reaped rank 1
"""

import json
import os
import signal
import subprocess
import sys
import time

import torch

import disttrain

scenario, piddir = sys.argv[1], sys.argv[2]
comm = disttrain.init()
rank = comm.rank
with open(os.path.join(piddir, f"pid-rank{rank}"), "w") as f:
    f.write(str(os.getpid()))
if scenario == "sigkill" and rank == 0:
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(piddir, "pid-grandchild"), "w") as f:
        f.write(str(child.pid))

value = torch.tensor([float(rank + 1)])
comm.all_reduce(value)  # collective #1: everybody is up
print(f"warm-up sum {value.item()}", flush=True)

if scenario == "ok":
    disttrain.monitored_barrier(comm, timeout_s=30)
    print(json.dumps({"rank": rank, "world_size": comm.world_size, "sum": value.item()}),
          flush=True)
    disttrain.shutdown(comm)
elif scenario == "sigkill" and rank == 1:
    # die once every other rank is about to enter collective #2 (and then some): a fixed
    # sleep could end first on a loaded machine, and a survivor be stopped elsewhere
    others = [os.path.join(piddir, f"entering2-rank{r}") for r in range(comm.world_size)
              if r != rank]
    deadline = time.monotonic() + 60
    while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
elif scenario == "raise" and rank == 1:
    time.sleep(0.5)
    raise ValueError("boom from rank 1")
elif scenario == "stuck" and rank == 1:
    time.sleep(120)
elif scenario == "tworaise":
    if rank == 0:  # fail just after the launcher has seen rank 1 fail (it reaps it then)
        with open(os.path.join(piddir, "pid-rank1")) as f:
            other = int(f.read())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(other, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        time.sleep(0.15)
    raise ValueError(f"rank {rank} gives up on its own")
elif scenario == "desync":
    comm.all_reduce(torch.ones(4 + rank))
else:
    open(os.path.join(piddir, f"entering2-rank{rank}"), "w").close()
    comm.all_reduce(torch.ones(8))  # collective #2, which some peer never completes
    print("unexpected: collective #2 completed", flush=True)
