"""Every rank raises an error of its own after one all-reduce. An exit handler registered
before disttrain.init(), so that it runs after disttrain's, writes whether the process
group was still alive then, that is, left to interpreter shutdown (where freeing a Gloo
group can abort the process: "terminate called without an active exception")."""

import atexit
import os
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]


def probe() -> None:
    with open(os.path.join(out, f"group-rank{os.environ['RANK']}"), "w") as f:
        f.write(str(dist.is_initialized()))


atexit.register(probe)

import disttrain  # noqa: E402  (after the probe: exit handlers run last in, first out)

comm = disttrain.init()
comm.all_reduce(torch.ones(1))
raise ValueError(f"rank {comm.rank} gives up on its own")
