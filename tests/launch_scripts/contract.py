"""A disttrain.init() worker for any launcher (srun, mpirun, torchrun, disttrain launch).

    contract.py sum DIR    all-reduce rank+1 and print {"rank", "world_size", "sum", ...}
    contract.py overlap DIR  the same, in a step of an srun job that runs beside another
                           step: both steps' rank 0 signal DIR/up-step<S> and every rank
                           waits for both before a second all-reduce, so the two steps'
                           rendezvous stores are up at the same time
    contract.py kill DIR   rank 1 SIGKILLs itself (writing DIR/killed-at first) while the
                           others wait in all-reduce #2; they print the error they got and
                           when, as JSON, and exit 1

One JSON object per rank on stdout, prefixed ``[rank R] `` so that outputs of launchers that
do not prefix lines read the same.
"""

import json
import os
import signal
import sys
import time

import torch

import disttrain

scenario, piddir = sys.argv[1], sys.argv[2]
comm = disttrain.init()
rank = comm.rank


def report(**fields):
    print(f"[rank {rank}] " + json.dumps({"rank": rank, **fields}), flush=True)


value = torch.tensor([float(rank + 1)])
comm.all_reduce(value)
if scenario == "overlap":
    step = os.environ.get("SLURM_STEP_ID", "?")
    if rank == 0:
        open(os.path.join(piddir, f"up-step{step}"), "w").close()
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(piddir) if n.startswith("up-step")]) < 2:
        if time.monotonic() > deadline:
            sys.exit("the other step never came up")
        time.sleep(0.05)
    comm.all_reduce(value)  # both steps are up: each still talks to its own ranks only
    scenario = "sum"
if scenario == "sum":
    report(world_size=comm.world_size, sum=value.item(), pid=os.getpid(),
           master=os.environ.get("MASTER_ADDR", ""), step=os.environ.get("SLURM_STEP_ID"))
    disttrain.shutdown(comm)
elif scenario == "kill" and rank == 1:
    others = [os.path.join(piddir, f"entering-rank{r}") for r in range(comm.world_size)
              if r != rank]
    deadline = time.monotonic() + 60
    while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the others are inside all-reduce #2 by now
    with open(os.path.join(piddir, "killed-at"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
elif scenario == "kill":
    open(os.path.join(piddir, f"entering-rank{rank}"), "w").close()
    try:
        comm.all_reduce(torch.ones(8))
        report(error=None)
    except Exception as exc:
        report(error=f"{type(exc).__name__}: {exc}", at=time.time(),
               suspects=list(getattr(exc, "suspects", ())))
        sys.exit(1)
