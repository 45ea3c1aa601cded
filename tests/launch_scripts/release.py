"""After disttrain's shutdown, no process group is left for interpreter shutdown to free.

Usage: release.py HOW, HOW one of ``comm`` (``disttrain.shutdown(comm)``), ``no-arg``
(``disttrain.shutdown()``: it closes what ``init`` returned) or ``exit`` (no call: disttrain's
exit handler shuts down). A sub-communicator and a shared-memory communicator are made and
used, the latter closed; then, in an exit handler that runs after disttrain's, weak
references tell whether torch's groups were freed (freeing a Gloo group during interpreter
shutdown can abort the process) and each communicator is used once more. One JSON line.
"""

import atexit
import gc
import json
import sys
import weakref

import torch
import torch.distributed as dist

import disttrain
from disttrain.comm import Communicator
from disttrain.comm.transports.shm import SharedMemoryTransport

how = sys.argv[1]
seen = {}


def report() -> None:  # registered before disttrain.init: runs after its exit handler
    gc.collect()
    after = {}
    for name in ("comm", "pair", "shm"):
        try:
            seen[name].all_reduce(torch.ones(1))
            after[name] = "no error"
        except Exception as exc:
            after[name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"rank": seen["rank"], "sum": seen["sum"],
                      "world_pg_freed": seen["world_pg"]() is None,
                      "sub_pg_freed": seen["sub_pg"]() is None, "after_close": after}),
          flush=True)


atexit.register(report)
comm = disttrain.init()
pair = comm.new_group([1, 0])
shm = Communicator(SharedMemoryTransport())
seen.update(comm=comm, pair=pair, shm=shm, rank=comm.rank,
            world_pg=weakref.ref(dist.group.WORLD),
            sub_pg=weakref.ref(pair.transport.native_group))
t = torch.ones(3)
pair.all_reduce(t)
shm.all_reduce(t)
seen["sum"] = t.tolist()
shm.close()
if how == "comm":
    disttrain.shutdown(comm)
elif how == "no-arg":
    disttrain.shutdown()
elif how != "exit":
    raise SystemExit(f"unknown HOW {how!r}")
del comm, pair, shm, t
