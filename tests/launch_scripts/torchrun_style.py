"""A worker written for torchrun: reads the env contract, calls init_process_group (env://)."""

import json
import os
import sys

import torch
import torch.distributed as dist

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

env = {name: os.environ.get(name) for name in NAMES}
dist.init_process_group("gloo")
value = torch.tensor([float(int(os.environ["RANK"]) + 1)])
dist.all_reduce(value)
print(json.dumps({"env": env, "sum": value.item(), "argv": sys.argv[1:]}), flush=True)
print(f"a line on stderr from rank {env['RANK']}", file=sys.stderr, flush=True)
dist.destroy_process_group()
