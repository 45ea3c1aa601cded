"""disttrain.init() from whatever the environment says, one all-reduce, one JSON line."""

import json
import os

import torch

import disttrain
from disttrain.launch import resolve_placement

place = resolve_placement(os.environ)
comm = disttrain.init()
value = torch.tensor([float(comm.rank + 1)])
comm.all_reduce(value)
print(json.dumps({"rank": comm.rank, "world_size": comm.world_size, "sum": value.item(),
                  "local_rank": place.local_rank, "master_addr": place.master_addr,
                  "source": place.source, "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}),
      flush=True)
disttrain.shutdown(comm)
